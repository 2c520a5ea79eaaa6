"""A turn: the runner under a fiber lease, the model/tool loop, the provider adapter, chunking and
error classification, tools, context overflow, and how an interrupted turn is recovered."""
