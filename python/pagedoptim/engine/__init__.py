"""The Python side of the native engine's step: the step under torch.compile (one custom op,
`compiled_step`), steps interrupted midway (`interrupted_step`), the guard that gradient
release puts on torch's clipping functions (`release_guard`) and the open/closed lifecycle
of an optimizer's state (`lifecycle`). Imports state/ and paging/ only."""
