// The hyperparameters of one parameter group, as the step driver receives them from Python
// (doubles, as torch keeps them). Plain structs: the CUDA scalar-preparation kernel reads
// them from device memory too.
#pragma once

namespace pagedoptim::optim {

struct AdamWGroup {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad, maximize;
};

struct SGDGroup {
  double lr, momentum, dampening, weight_decay;
  bool nesterov, maximize;
};

struct LionGroup {
  double lr, beta1, beta2, weight_decay;
  bool maximize;
};

struct SkewAdamGroup {
  double lr, beta1, beta2, eps, weight_decay;
};

}  // namespace pagedoptim::optim
