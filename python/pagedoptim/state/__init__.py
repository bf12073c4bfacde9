"""The state's formats, below everything that steps it: how each moment is stored (fp32, or
8-bit codes with fp16 group scales, plus master residuals), which moments each algorithm has
(`format.MOMENTS`), how a sharded param's state is cut (`sharding`), the per-param view
`optimizer.state[p]` hands out (`param_state`) and the checks a loaded state_dict passes
(`checks`). Nothing here knows an optimizer class; it imports only pagedoptim._native."""
