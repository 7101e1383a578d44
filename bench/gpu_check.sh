#!/usr/bin/env bash
# GPU check: the trainer's GPU path and a real CUDA vLLM swap, end to end, on ONE GPU in < 10 min.
#
# NOT RUN HERE: the machines this repository is developed on have no GPU, so this script has never
# been executed; it is kept short and checks every step so that a first run says plainly what fails.
#
#   bench/gpu_check.sh [WORKDIR]     (needs: nvidia-smi, this repo's environment via `uv sync
#                                     --all-extras`, and a CUDA vLLM with VLLM_SERVER_DEV_MODE
#                                     endpoints: VLLM=/path/to/vllm, default `vllm` on PATH)
#
# Steps: build the SmolLM2-135M folder → vLLM (CUDA, bf16) serves it → 4 groups × 8 answers sampled
# from it with their logprobs → the trainer (--device cuda, bf16 autocast) trains 2 versions from them
# → each version is swapped into the server (pause → reload_weights → version → resume) → the server
# reports the version and its logprobs moved. Prints the pause per swap and the trainer's tokens/s.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-$(mktemp -d /tmp/gpu-check-XXXX)}
VLLM=${VLLM:-vllm}
PORT=${PORT:-8765}
fail() { echo "gpu_check: FAIL: $*" >&2; exit 1; }
command -v nvidia-smi >/dev/null && nvidia-smi -L | grep -q GPU || fail "no NVIDIA GPU visible (nvidia-smi -L)"
command -v "$VLLM" >/dev/null || fail "no vLLM at '$VLLM': pip install vllm in its own venv and set VLLM=…/bin/vllm"
uv run python -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA'" || fail "torch without CUDA"

echo "1/5 model folder"; uv run agentstream model smollm2 "$WORK/smollm2" >/dev/null
echo "2/5 vLLM (CUDA) on :$PORT"
VLLM_SERVER_DEV_MODE=1 "$VLLM" serve "$WORK/smollm2" --served-model-name smollm2 --port "$PORT" --dtype bfloat16 \
  --gpu-memory-utilization 0.3 --max-model-len 2048 --hf-overrides '{"tie_word_embeddings": false}' \
  >"$WORK/vllm.log" 2>&1 &
VLLM_PID=$!
trap 'kill $VLLM_PID 2>/dev/null; wait $VLLM_PID 2>/dev/null || true' EXIT
for _ in $(seq 240); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 1; done
curl -sf "localhost:$PORT/health" >/dev/null || fail "vLLM did not come up in 4 min (see $WORK/vllm.log)"

echo "3/5 sampling 32 answers"
uv run python - "$PORT" "$WORK" <<'PY' || fail "sampling"
import sys, httpx, schemas as s
from tests.support.trainer import trajectory
port, work = sys.argv[1], sys.argv[2]
lines = []
for g, question in enumerate(["Name a fruit.", "Name a color.", "Name an animal.", "Name a country."]):
    r = httpx.post(f"http://localhost:{port}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "messages": [{"role": "user", "content": question + " One word."}], "n": 8,
        "max_tokens": 16, "temperature": 1.0, "logprobs": True, "return_token_ids": True, "seed": g}).json()
    for i, c in enumerate(r["choices"]):
        logprobs = [e["logprob"] for e in c["logprobs"]["content"]]
        reward = 1.0 if len(c["message"]["content"].split()) == 1 else 0.0
        lines.append(s.encode(trajectory(r["prompt_token_ids"], c["token_ids"], reward, f"q{g}", i, logprobs,
                                         model="smollm2")))
open(f"{work}/trajectories.jsonl", "wb").write(b"\n".join(lines) + b"\n")
PY

echo "4/5 training 2 versions on the GPU"
uv run python -m agentstream.trainer --offline-file "$WORK/trajectories.jsonl" --model smollm2 --base-model "$WORK/smollm2" \
  --checkpoint-dir "$WORK/ckpt" --device cuda --dtype auto --group-size 8 --groups-per-batch 2 --lr 2e-5 \
  --micro-batch-tokens 4096 --max-staleness 100 --bootstrap-servers "${KAFKA_BOOTSTRAP_SERVERS:-127.0.0.1:9092}" \
  >"$WORK/trainer.log" 2>&1 || fail "trainer (see $WORK/trainer.log; it needs a Kafka broker for its weights events: \
uv run agentstream kafka start)"

echo "5/5 swapping both versions in"
uv run python - "$PORT" "$WORK" <<'PY' || fail "swap"
import json, sys, time, httpx
from pathlib import Path
port, work = sys.argv[1], Path(sys.argv[2])
url = f"http://localhost:{port}"
def logprob_of(text):
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "smollm2", "prompt": text, "max_tokens": 1,
                                                              "prompt_logprobs": 0, "temperature": 0}).json()
    return sum(next(iter(e.values()))["logprob"] for e in r["choices"][0]["prompt_logprobs"][1:])
before = logprob_of("Name a fruit. One word. Apple")
for folder in sorted((work / "ckpt").glob("v0*")):
    event = json.loads((folder / "training_state" / "weights_event.json").read_text())["data"]
    started = time.perf_counter()
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).status_code == 200
    r = httpx.post(f"{url}/collective_rpc", timeout=300, json={"method": "reload_weights",
                                                             "kwargs": {"weights_path": str(folder)}})
    assert r.status_code == 200, r.text
    assert httpx.post(f"{url}/update_weight_version", json={"new_version": str(event["version"])}).status_code == 200
    assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
    pause = time.perf_counter() - started
    served = httpx.get(f"{url}/weight_info").json()["weight_version"]
    assert served == str(event["version"]), served
    m = event["metrics"]
    print(f"version {event['version']}: pause {pause * 1000:.0f} ms | trainer {m['tokens'] / m['train_s']:.0f} "
          f"tokens/s ({m['tokens']:.0f} tokens in {m['train_s']:.2f} s) | loss {m['loss']:.4f}")
after = logprob_of("Name a fruit. One word. Apple")
assert abs(after - before) > 1e-3, "the served logprobs did not move after two versions"
print(f"OK: 2 versions trained on the GPU and served (logprob of a fixed answer {before:.3f} -> {after:.3f})")
PY
