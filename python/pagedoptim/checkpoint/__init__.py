"""Checkpoints: the streamed page-by-page file format (`format`, `stream`), atomic writes
(`atomic_file`), which algorithm saved a state_dict (`algorithms`) and the conversions
between torch.optim's fp32 format and ours (`conversion`). Imports state/ and below."""
