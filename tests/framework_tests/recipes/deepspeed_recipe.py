"""DeepSpeed on the CPU: ``gradsync.torch.distributed.init()`` before
``deepspeed.initialize()`` (which otherwise creates the default group on its
accelerator's backend, gloo on the CPU, and has no option naming another);
DeepSpeed's comm layer then uses the group it finds. ZeRO stage from argv[3]
(0 when absent); a torch optimizer, so no DeepSpeed op is compiled."""
import sys

import torch
from _common import args, make_data, make_model, save

backend, out_dir = args()
stage = int(sys.argv[3]) if len(sys.argv) > 3 else 0
if backend == "gradsync":
    import gradsync.torch.distributed as gtd
    gtd.init()

import deepspeed  # noqa: E402

model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": stage}, "steps_per_print": 1000}
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
x, y = make_data()
rank, size = engine.global_rank, engine.world_size
assert size == 2, size
losses = []
for step in range(4):
    batch = slice(16 * step + 8 * rank, 16 * step + 8 * rank + 8)
    loss = torch.nn.functional.mse_loss(engine(x[batch]), y[batch])
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
if stage == 3:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        params = [(k, v.detach().clone()) for k, v in engine.module.named_parameters()]
else:
    params = list(engine.module.named_parameters())
save(out_dir, params, {"losses": losses, "steps": engine.global_steps})
