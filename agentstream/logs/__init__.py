"""Tools that read the log: replay and export (`replay/`), SQL over the streams (`query`; its result
as asked for: `results`), repeated attempts (`repeats`) and the live view (`top`). They read topics and
write files or new topics; no service depends on them."""
