"""The Python face of the native engine: `StateStore` (`state_store`: one optimizer's paged
state, its slots and stream layouts, and `replacing_state`, the transaction of every load),
`StepBatch` (`step_batch`: the arguments of one native step call), the step under
torch.compile (one custom op, `compiled_step`), steps interrupted midway
(`interrupted_step`), gradient release's hooks and the guard it puts on torch's clipping
functions (`release_hooks`, `release_guard`) and the open/closed lifecycle of an
optimizer's state (`lifecycle`). Imports state/ and paging/ only."""
