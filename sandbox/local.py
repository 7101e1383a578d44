"""The local sandbox: every command in its own bubblewrap, as an unprivileged uid of its own.

One `LocalSandbox` per attempt (it must be created by root):
  1. it leases a uid nobody else uses (UID_BASE + n, held by an flock): the kernel exempts root from
     RLIMIT_NPROC, so a fork bomb is only stopped as another uid, and one uid per sandbox makes the
     process limit that sandbox's alone; and a cgroup of its own (`sandbox.cgroups`: memory with page
     cache, pids, cpu quota, summed over all its processes);
  2. it copies the workspace onto an ext4 disk of `Limits.disk_bytes` (`sandbox.disk`) mounted over the
     workspace's folder for the sandbox's life (so the caller sees and writes it live, as before, and
     every block the agent takes is the disk's);
  3. it makes its own mount and network namespaces once (`sandbox.namespaces`): the workspace and the
     caller's binds are staged under a path that uid may traverse, and the network is a bare loopback
     (plus the gateway relay in whole-harness mode, `sandbox.relay`);
  4. each `run` starts, as root, `sh` (joins the cgroup) → `nsenter` (those namespaces, then the uid) →
     `prlimit` (the rlimits) → `bwrap` (a new user, pid, ipc and uts namespace, all capabilities dropped,
     no further user namespaces, a read-only system, the workspace the one writable tree, a private
     /tmp, an /etc of a few harmless files, an empty environment plus `SandboxSpec.env`) → `bash -c
     COMMAND`;
  5. the command's wall clock is enforced here: past it, bubblewrap is killed, its pid-1 dies with it
     (--die-with-parent) and with that every process of the pid namespace; whatever is left in the
     cgroup is killed before `run` returns;
  6. `close` kills what still runs, copies the disk's tree back into the folder beneath it as its owner
     (`sandbox.hostfs`: no link followed, no recursion, no more than the disk's blocks and inodes),
     unmounts the disk (its loop device and image go with it), drops the namespaces, removes the cgroup
     and frees the uid, whatever fails on the way.
If the process holding it dies instead (kill -9, SIGTERM), its warden (`sandbox.warden`, one per process)
does step 6 for it. Where the host has no loop devices or cgroups, it says so once in the log and falls back: the
workspace is bound directly (chowned to the uid and back), the rlimits alone bound the commands.
"""

from __future__ import annotations

import fcntl
import logging
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import SplitResult, urlsplit, urlunsplit

from agentstream.sandbox import cgroups, disk, hostfs, namespaces, relay, warden
from agentstream.sandbox.contract import WORKSPACE_MOUNT, CommandResult, Network, SandboxError, SandboxSpec
from agentstream.sandbox.output import collect, limit_of

log = logging.getLogger(__name__)

UID_BASE = 600_000
UID_SLOTS = 4096
INSIDE_UID = 1000
"""the uid commands see (the leased host uid is mapped to it)"""
"""bytes of output kept per command: the first and last halves, with a marker between"""
STATE_DIR = Path("/tmp/agentstream-sandbox")
STAGE = STATE_DIR / "stage"
"""an empty directory on the host; each sandbox mounts its own tmpfs over it, in its own mount namespace"""
DISKS = STATE_DIR / "disks"
WORKSPACE_WAIT_S = 30.0
"""how long a new sandbox waits for another one on the same workspace (or its clean-up) to end"""
"""where a workspace disk's image is made (and unlinked at once: the loop device holds it)"""
NPROC_MARGIN = 16
"""RLIMIT_NPROC above Limits.processes where the pids cgroup enforces it: the cgroup is the line a fork
bomb meets (exact, and reported by pids.events), the rlimit the one behind it"""
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "USER": "agent",
    "LANG": "C.UTF-8",
}
ETC_SHARED = (
    "alternatives", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "protocols",
    "services", "os-release", "debian_version", "ssl/certs", "ssl/openssl.cnf", "ca-certificates",
    "python3", "python3.11", "mime.types", "magic", "magic.mime", "inputrc", "terminfo", "locale.alias",
    "gai.conf", "host.conf", "shells",
)
"""the host's /etc entries a command may see (gathered once per sandbox); everything else in /etc (gitconfig
with its credential helper, pip.conf, npmrc, ssh, shadow, ssl/private, …) is absent, and the identity
files (passwd, group, hosts, resolv.conf, nsswitch.conf) are written anew"""
SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
REAPER = '/bin/bash -c "$1"; exit'
"""pid 1 of each command: a bash that runs the command as its child (never exec'ed in its place, thanks to
the `exit` after it) and so reaps every orphan in the pid namespace. bubblewrap's own reaper is not used
(--as-pid-1): its outer process exits without waiting for it, which leaves a zombie of the sandbox uid
(counted against its process limit) under the host's pid 1, and in a container that pid 1 may never reap."""
MISSING_TOOL = {
    "bwrap": "bubblewrap is not installed: `apt-get install -y bubblewrap`",
    "nsenter": "nsenter (util-linux) is not installed: `apt-get install -y util-linux`",
    "prlimit": "prlimit (util-linux) is not installed: `apt-get install -y util-linux`",
}

def _tool(name: str) -> str:
    """The path of a host tool the sandbox runs, or the error that says how to install it."""
    path = shutil.which(name)
    if path is None:
        raise SandboxError(MISSING_TOOL[name])
    return path


def inside_gateway_url(url: str) -> str:
    """The gateway URL as a whole-harness sandbox must use it: the same, unless its host is an IP address
    other than 127.0.0.1 (then 127.0.0.1, where the relay listens). Host names resolve to the relay via
    the sandbox's /etc/hosts, so TLS names and virtual hosts still match."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if is_ip(host) and host != "127.0.0.1":
        netloc = f"127.0.0.1:{_port(parts)}"
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def python_binds(venv: Path) -> list[tuple[Path, Path]]:
    """What a caller binds so that `venv` (made by `uv venv` or `python -m venv`) runs inside: the venv at
    its own path (its scripts name it in their shebangs) and the interpreter it was made from
    (pyvenv.cfg's `home`, e.g. ~/.local/share/uv/python/cpython-…/bin) unless that is under /usr."""
    venv = venv.resolve()
    config = venv / "pyvenv.cfg"
    if not config.is_file():
        raise SandboxError(f"{venv} is not a virtual environment (no pyvenv.cfg); make one with `uv venv {venv}`")
    home = next((line.split("=", 1)[1].strip() for line in config.read_text().splitlines()
                 if line.split("=", 1)[0].strip() == "home"), None)
    binds = [(venv, venv)]
    if home:
        prefix = Path(home).resolve().parent  # …/cpython-3.11-…/bin → the installation, with its lib/
        if not any(prefix.is_relative_to(f"/{system}") for system in SYSTEM_DIRS):
            binds.append((prefix, prefix))
    return binds


class LocalSandbox:
    """`Sandbox` on this machine with bubblewrap. See the module docstring for how."""

    def __init__(self, spec: SandboxSpec):
        self.spec = spec
        self._check_host()
        self._check_spec()
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen[bytes]] = set()
        self._closed = False
        self._relay: relay.Relay | None = None
        self._ns: namespaces.Namespaces | None = None
        self._cgroup: cgroups.Cgroup | None = None
        self._disk: WorkspaceDisk | None = None
        self.close_problems: list[str] = []
        """what `close` could not do (also logged): entries of the workspace not copied back, …"""
        self.started = time.monotonic()
        self.deadline = self.started + spec.limits.attempt_timeout_s
        self._lease = UidLease.acquire()
        self.uid = self._lease.uid
        self.workspace = spec.workspace.resolve()
        self._folder = -1
        self._warden_id, self._watched = warden.new_id(), False
        try:
            self._folder = claim_workspace(self.workspace)
            self._owner = workspace_owner(self.workspace)
            _remove_stale_cgroups()
            self._cgroup = cgroups.create(str(self.uid), spec.limits)
            self._tell_warden()
            self._disk = WorkspaceDisk.mount(self.workspace, self._folder, self.uid, spec.limits.disk_bytes,
                                             self._warden_id)
            if self._disk is None:
                _raise_on(hostfs.chown_tree(self.workspace, self.uid, self.uid), "could not hand the workspace over")
            etc = [(Path("/etc") / entry, f"etc/{entry}") for entry in ETC_SHARED]
            self._ns = namespaces.create(STAGE, self._staged(), etc, self._etc_files(), self._listen_port())
            if spec.network is Network.GATEWAY:
                assert self._ns.listener is not None
                self._relay = relay.Relay(self._ns.listener, _gateway_address(spec.gateway_url or ""))
                self._ns.listener = None  # the relay owns it now
            self._argv_head = self._fixed_argv(self._ns)
        except BaseException:
            self.close()
            raise

    # --- set-up ---------------------------------------------------------------------------

    @staticmethod
    def _check_host() -> None:
        for tool in MISSING_TOOL:
            _tool(tool)
        if os.geteuid() != 0:
            raise SandboxError("the local sandbox must be created by root: it runs commands as a uid of their own "
                               "(run the harness or controller as root, as the platform's images do)")
        STAGE.mkdir(parents=True, exist_ok=True)
        for folder in (STATE_DIR, STAGE):
            if folder.lstat().st_uid != 0 or folder.is_symlink():
                raise SandboxError(f"{folder} is not root's own directory; remove it and try again")
            folder.chmod(0o755)  # the sandbox uids traverse it

    def _tell_warden(self) -> None:
        """What the warden must undo if this process dies with the sandbox open (`sandbox.warden`)."""
        group = {"dirs": {k: str(v) for k, v in self._cgroup.dirs.items()}, "version": self._cgroup.version} \
            if self._cgroup else None
        bound = disk.available() is not None
        warden.tell({"op": "hold", "id": self._warden_id, "workspace": str(self.workspace), "owner": self._owner,
                     "cgroup": group, "bound": bound, "disks": "" if bound else str(DISKS), "fds": ["lease", "folder"]},
                    [self._lease.fd, self._folder])
        self._watched = True

    def _check_spec(self) -> None:
        spec = self.spec
        if not spec.workspace.is_dir():
            raise SandboxError(f"workspace {spec.workspace} is not a directory; create it before the sandbox")
        for source, target in spec.binds:
            if not Path(source).exists():
                raise SandboxError(f"bind source {source} does not exist")
            if not Path(target).is_absolute() or Path(target) == WORKSPACE_MOUNT:
                raise SandboxError(f"bind target {target} must be an absolute path other than {WORKSPACE_MOUNT}")
        gateway = urlsplit(spec.gateway_url or "")
        if spec.network is Network.GATEWAY and (not gateway.hostname or gateway.scheme not in ("http", "https")):
            raise SandboxError("Network.GATEWAY needs SandboxSpec.gateway_url, the gateway as the host sees it "
                               "(http://host:port/…)")

    def _staged(self) -> list[tuple[Path, str]]:
        return [(self.workspace, "workspace")] + [
            (Path(source).resolve(), f"bind-{n}") for n, (source, _) in enumerate(self.spec.binds)]

    def _listen_port(self) -> int | None:
        if self.spec.network is not Network.GATEWAY:
            return None
        return _gateway_address(self.spec.gateway_url or "")[1]

    def _etc_files(self) -> dict[str, str]:
        hosts = "127.0.0.1\tlocalhost sandbox\n"  # no ::1: the relay listens on IPv4 only
        if self.spec.network is Network.GATEWAY:
            host = urlsplit(self.spec.gateway_url or "").hostname or ""
            if host and not is_ip(host) and host != "localhost":
                hosts += f"127.0.0.1\t{host}\n"  # the relay answers for the gateway's name
        return {
            "etc/passwd": "root:x:0:0:root:/root:/usr/sbin/nologin\n"
                          f"agent:x:{INSIDE_UID}:{INSIDE_UID}:agent:/tmp:/bin/bash\n"
                          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
            "etc/group": f"root:x:0:\nagent:x:{INSIDE_UID}:\nnogroup:x:65534:\n",
            "etc/hosts": hosts,
            "etc/hostname": "sandbox\n",
            "etc/resolv.conf": "# no name server: the sandbox has no network (whole-harness: the gateway only)\n",
            "etc/nsswitch.conf": "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n"
                                 "protocols: files\nservices: files\n",
        }

    def _fixed_argv(self, ns: namespaces.Namespaces) -> list[str]:
        """Everything of the command line but the per-command part (cwd, the command)."""
        limits = self.spec.limits
        argv = [*ns.nsenter(), f"--setuid={self.uid}", f"--setgid={self.uid}", "--",
                _tool("prlimit"), f"--cpu={limits.cpu_seconds}:{limits.cpu_seconds + 1}",
                f"--as={limits.address_space}",
                f"--nproc={limits.processes + (NPROC_MARGIN if self._cgroup else 0)}",
                f"--fsize={limits.file_size_bytes}", "--core=0", "--",
                _tool("bwrap"), "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-ipc",
                "--unshare-uts",
                "--unshare-cgroup-try", "--hostname", "sandbox", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID),
                "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--as-pid-1"]
        for name in SYSTEM_DIRS:
            host = Path("/") / name
            if host.is_symlink():
                argv += ["--symlink", os.readlink(host), str(host)]
            elif host.is_dir():
                argv += ["--ro-bind", str(host), str(host)]
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm",
                 "--remount-ro", "/dev", "--size", str(limits.tmp_bytes), "--tmpfs", "/tmp",
                 "--dir", "/var", "--symlink", "../tmp", "/var/tmp"]
        argv += ["--ro-bind", str(STAGE / "etc"), "/etc"]
        argv += ["--bind", str(STAGE / "workspace"), str(WORKSPACE_MOUNT)]
        for n, (_, target) in enumerate(self.spec.binds):
            argv += ["--ro-bind", str(STAGE / f"bind-{n}"), str(target)]
        argv += ["--remount-ro", "/", "--clearenv"]
        for key, value in {**DEFAULT_ENV, **self.spec.env}.items():
            argv += ["--setenv", key, value]
        return argv

    # --- commands -------------------------------------------------------------------------

    def run(self, command: str, timeout_s: float | None = None, cwd: str | None = None) -> CommandResult:
        """Run `bash -c command` inside; `timeout_s` replaces Limits.command_timeout_s for this command (the
        attempt's deadline still holds); `cwd` is relative to the workspace (or absolute inside)."""
        if self._closed:
            raise SandboxError("this sandbox is closed; open a new one")
        began = time.monotonic()
        left = self.deadline - began
        if left <= 0:
            return CommandResult.not_run(command, self.spec.limits)
        budget, timeout_limit = self.spec.limits.budget(left, timeout_s)
        inside_cwd = str(WORKSPACE_MOUNT / (cwd or ""))  # an absolute cwd replaces the workspace
        status_read, status_write = os.pipe()
        join = self._cgroup.join_argv() if self._cgroup else []
        argv = [*join, *self._argv_head, "--chdir", inside_cwd, "--json-status-fd", str(status_write),
                "--", "/bin/bash", "-c", REAPER, "sandbox", command]
        oom_kills, fork_refusals = self._cgroup_counters()
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, env={}, pass_fds=(status_write,),
                                       start_new_session=True)
        finally:
            os.close(status_write)
        with self._lock:
            self._running.add(process)
        try:
            output, timed_out = collect(process, began + budget, until_eof=True)
            at_process_limit = timed_out and processes_of(self.uid) >= self.spec.limits.processes - 1
            if timed_out:
                process.kill()
            exit_code = process.wait()
            with self._lock:
                alone = self._running == {process}
            if self._cgroup is not None and alone:  # nothing of the command outlives it, timed out or not
                self._cgroup.kill_all()
            if timed_out:  # bubblewrap is gone; its pid 1 dies of it a moment later (and is reaped by the host's)
                await_no_processes(self.uid)
        finally:
            if process.returncode is None:  # interrupted (a signal's exception in this thread): end the command
                self._end(process)
            with self._lock:
                self._running.discard(process)
            with os.fdopen(status_read, "rb") as status_file:
                status = status_file.read().decode(errors="replace")
        duration = time.monotonic() - began
        text = output.text()
        if "child-pid" not in status and not timed_out:
            raise SandboxError(f"bubblewrap could not set up the sandbox (exit {exit_code}): {text.strip()[-2000:]}")
        oom_killed, forks_refused = (now > then for now, then in zip(self._cgroup_counters(), (oom_kills, fork_refusals)))
        if timed_out:
            limit = "processes" if at_process_limit or forks_refused else timeout_limit
            note = {"processes": f"it reached the limit of {self.spec.limits.processes} processes and ran out of time",
                    "command_timeout": f"it ran past {budget:g} s",
                    "attempt_timeout": "the attempt's time ran out"}[limit]
            return CommandResult(command, -signal.SIGKILL, f"{text}\n[sandbox: killed: {note}]", duration, limit)
        if oom_killed:
            return CommandResult(command, exit_code, f"{text}\n[sandbox: a process was killed: the sandbox's "
                                 f"{self.spec.limits.memory_bytes} bytes of memory ran out]", duration, "memory")
        reported = limit_of(exit_code, output.tail_text()) or ("processes" if forks_refused and exit_code else None)
        return CommandResult(command, exit_code, text, duration, reported)

    def _end(self, process: subprocess.Popen[bytes]) -> None:
        """Kill a command and, unless another runs beside it, whatever of the sandbox is left."""
        process.kill()
        process.wait()
        with self._lock:
            alone = self._running == {process}
        if self._cgroup is not None and alone:
            self._cgroup.kill_all()

    def _cgroup_counters(self) -> tuple[int, int]:
        return (self._cgroup.oom_kills(), self._cgroup.fork_refusals()) if self._cgroup else (0, 0)

    # --- the end --------------------------------------------------------------------------

    def close(self) -> None:
        """Kill what runs, give the workspace back to its owner, free the namespaces (and the disk), remove
        the cgroup, free the uid. Each step runs whatever the ones before met; what could not be done is
        logged and kept in `close_problems`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        problems: list[str] = []
        for step in (self._end_processes, self._give_back_workspace, self._end_namespaces, self._remove_cgroup):
            try:
                step(problems)
            except Exception as error:
                problems.append(f"{step.__name__.strip('_')}: {error!r}")
        # the warden lets go of its copies first: a death from here on leaves nothing it should undo
        if self._watched:
            warden.tell({"op": "done", "id": self._warden_id})
        if self._folder >= 0:
            fcntl.flock(self._folder, fcntl.LOCK_UN)  # also for the warden's copy: the next sandbox need not wait
            os.close(self._folder)
            self._folder = -1
        self._lease.release()
        self.close_problems = problems
        if problems:
            log.warning("sandbox %s (workspace %s) closed with problems:\n  %s", self.uid, self.workspace,
                        "\n  ".join(problems))

    def _end_processes(self, problems: list[str]) -> None:
        with self._lock:
            running = list(self._running)
        for process in running:
            process.kill()
            process.wait()
        if self._cgroup is not None and not self._cgroup.kill_all():
            problems.append(f"processes of uid {self.uid} survived the kill")
        if running:
            await_no_processes(self.uid)
        if self._relay is not None:
            self._relay.close()

    def _give_back_workspace(self, problems: list[str]) -> None:
        if not hasattr(self, "_owner"):
            return
        if self._disk is not None:
            problems += self._disk.unmount(*self._owner)
        elif disk.available() is None:  # a set-up interrupted between mounting the disk and keeping it
            problems += disk.take_off(self.workspace, self._folder, DISKS)
        else:
            problems += hostfs.chown_tree(self.workspace, *self._owner)

    def _end_namespaces(self, problems: list[str]) -> None:
        if self._ns is not None:
            # the last reference to the disk's filesystem goes with the mount namespace: its unmount writes
            # back what the agent left dirty (to an image already unlinked), which can take a second; the
            # host's view is detached already and nothing of the sandbox runs, so it need not be waited for
            threading.Thread(target=self._ns.close, name="sandbox-teardown").start()

    def _remove_cgroup(self, problems: list[str]) -> None:
        if self._cgroup is not None:
            problems += self._cgroup.remove()

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def relayed_connections(self) -> int:
        """connections the gateway relay has accepted (whole-harness mode)"""
        return self._relay.connections if self._relay else 0


# --- uids and ownership ---------------------------------------------------------------------


class UidLease:
    """A host uid for one sandbox: locked with flock (freed by the kernel if this process dies) and
    skipped while any process still runs as it."""

    def __init__(self, uid: int, fd: int):
        self.uid = uid
        self.fd = fd

    @classmethod
    def acquire(cls) -> UidLease:
        locks = STATE_DIR / "uids"
        locks.mkdir(parents=True, exist_ok=True)
        busy = uids_in_use()
        start = random.randrange(UID_SLOTS)
        for n in range(UID_SLOTS):
            uid = UID_BASE + (start + n) % UID_SLOTS
            if uid in busy:
                continue
            fd = os.open(locks / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(uid, fd)
        raise SandboxError(f"all {UID_SLOTS} sandbox uids are in use; close sandboxes that are done")

    @classmethod
    def hold_if_free(cls, uid: int) -> UidLease | None:
        """The lease of `uid` if nobody holds it (to clean up after a sandbox whose process died)."""
        try:
            fd = os.open(STATE_DIR / "uids" / str(uid), os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(uid, fd)

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)  # a copy the warden holds shares the lock: free it for both
            os.close(self.fd)
            self.fd = -1


def claim_workspace(workspace: Path, wait_s: float = WORKSPACE_WAIT_S) -> int:
    """The workspace's folder, opened and locked for one sandbox (an flock on it: the kernel frees it with its
    holders, the warden holds a copy through a dead sandbox's clean-up). A sandbox's disk found over it is
    waited for while its lock is held (an open sandbox, or the warden cleaning up after one) and taken off
    when nobody holds it (its host process and warden both died: its writes are lost, and logged)."""
    deadline = time.monotonic() + wait_s
    while True:
        fd = hostfs.open_dir(workspace)
        locked = _try_lock(fd)
        if locked and disk.is_sandbox_disk(fd, DISKS):
            try:  # this disk, not what is on top by now: its warden may have just taken it off, and a sandbox
                if disk.detach(fd):  # waiting beside this one mounted its own
                    log.warning("sandbox: %s had the disk of a sandbox whose process (and warden) died mounted over "
                                "it; unmounted, its changes are lost", workspace)
            finally:
                os.close(fd)
            continue
        if locked:
            return fd
        os.close(fd)
        if time.monotonic() > deadline:
            raise SandboxError(f"workspace {workspace} is in use by another sandbox (waited {wait_s:g} s): one "
                               "sandbox per workspace at a time")
        time.sleep(0.01)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _remove_stale_cgroups() -> None:
    """Groups of sandboxes whose host process died: removed while holding their uid's lease, so that no
    sandbox starting with that uid can lose its new group to this."""
    for name, dirs in cgroups.leftovers().items():
        lease = UidLease.hold_if_free(int(name)) if name.isdigit() else None
        if lease is not None:
            cgroups.remove_empty(dirs)
            lease.release()


def _proc_uids() -> Iterable[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                yield entry.stat().st_uid
            except FileNotFoundError:
                pass


def uids_in_use() -> set[int]:
    return set(_proc_uids())


def processes_of(uid: int) -> int:
    return sum(1 for owner in _proc_uids() if owner == uid)


def await_no_processes(uid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.005)


def workspace_owner(workspace: Path) -> tuple[int, int]:
    """Who gets the workspace back on close: its owner, or, if a sandbox that crashed left it owned by a
    sandbox uid, the owner of the folder it is in."""
    info = workspace.stat()
    if UID_BASE <= info.st_uid < UID_BASE + UID_SLOTS:
        info = workspace.parent.stat()
    return info.st_uid, info.st_gid


class WorkspaceDisk:
    """The workspace's copy on its own disk, mounted over the workspace's folder on the host."""

    def __init__(self, workspace: Path, folder_fd: int, root_fd: int, files: dict[int, tuple[int, int]]):
        self.workspace = workspace
        self.folder_fd = folder_fd
        """the host folder beneath the mount (where the copy goes back)"""
        self.root_fd = root_fd
        """the disk's root"""
        self.files = files
        """disk inode -> (host inode, disk ctime) of each file copied in"""

    @classmethod
    def mount(cls, workspace: Path, folder: int, uid: int, size: int, warden_id: int) -> WorkspaceDisk | None:
        """A fresh disk of `size` bytes over `workspace` (whose folder, claimed, is `folder`), holding a copy
        of it owned by `uid`; None where this host cannot make disks (logged once). The disk's root is locked
        (a sandbox on the folder finds it held, `claim_workspace`) and a copy handed to the warden."""
        why = disk.available()
        if why is not None:
            _warn_once("disk", f"sandbox: {why}; workspaces are bound directly and Limits.disk_bytes is not enforced")
            return None
        device, device_fd = disk.make(DISKS / f"{uid}.img", size, uid)
        try:
            disk.mount_over(device, workspace)
        finally:
            os.close(device_fd)  # the mount holds the device now; autoclear frees it after
        try:
            root = hostfs.open_dir(workspace)
        except BaseException:
            disk.unmount(workspace)
            raise
        made = cls(workspace, folder, root, {})
        try:
            fcntl.flock(root, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else has seen this disk yet
            warden.tell({"op": "disk", "id": warden_id, "fds": ["root"]}, [root])
        except BaseException:
            made.unmount(0, 0, copy_back=False)
            raise
        copied = hostfs.copy_tree(folder, root, uid, uid)
        made.files = copied.files
        if copied.problems:
            made.unmount(0, 0, copy_back=False)
            _raise_on(copied.problems, f"could not copy the workspace onto its disk of {size} bytes "
                                       "(if it is too small, raise Limits.disk_bytes)")
        return made

    def unmount(self, uid: int, gid: int, copy_back: bool = True) -> list[str]:
        """Copy the disk's tree back into the folder as uid:gid, then unmount it; what could not be done.
        What nobody touched inside (same inode and ctime as copied in: no write, chmod, rename or link
        since) is not copied again. At most the disk's blocks and inodes are written: hard links and holes
        cannot multiply them. The folder's descriptor stays open (its owner closes it)."""
        return disk.give_back(self.workspace, self.folder_fd, self.root_fd, uid, gid,
                              unchanged=self._unchanged if copy_back else None, copy_back=copy_back)

    def _unchanged(self, inside: os.stat_result, host: os.stat_result) -> bool:
        return (self.files.get(inside.st_ino) == (host.st_ino, inside.st_ctime_ns)
                and (host.st_size, host.st_mtime_ns) == (inside.st_size, inside.st_mtime_ns))


def _raise_on(problems: list[str], what: str) -> None:
    if problems:
        raise SandboxError(f"{what}: {'; '.join(problems[:5])}")


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


# --- addresses ------------------------------------------------------------------------------


def is_ip(host: str) -> bool:
    """An IP address (v4 or v6), not a name to resolve."""
    import ipaddress

    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _port(parts: SplitResult) -> int:
    return parts.port or (443 if parts.scheme == "https" else 80)


def _gateway_address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", _port(parts)
