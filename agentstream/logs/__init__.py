"""Tools that read the log: replay and export (`replay/`), SQL over the streams (`query`), repeated
attempts (`repeats`) and the live view (`top`). They read topics and write files or new topics; no
service depends on them."""
