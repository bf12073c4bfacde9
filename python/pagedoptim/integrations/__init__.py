"""Routes into training frameworks that build or wrap the optimizer themselves.

pagedoptim.integrations.transformers  HF Trainer: optimizers chosen by name (TrainingArguments'
                                      optim / optim_args), release_grads checked against the
                                      Trainer's clipping, accumulation and data parallelism
unwrap_optimizer                      our optimizer inside accelerate's (or any) wrapper, for
                                      memory_report() and paging_stats()

Importing this package imports no framework; pagedoptim.integrations.transformers imports
transformers.
"""

from pagedoptim.integrations.unwrap import unwrap_optimizer

__all__ = ["unwrap_optimizer"]
