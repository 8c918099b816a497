"""transformers' Trainer on the CPU: ``gradsync.torch.distributed.init()``
before TrainingArguments (``--ddp_backend`` accepts a fixed list of names,
and accelerate under it turns any CPU backend but "mpi" into gloo); the
Trainer then uses the group it finds."""
import torch
from _common import args, make_data, make_model, save

backend, out_dir = args()
if backend == "gradsync":
    import gradsync.torch.distributed as gtd
    gtd.init()

from transformers import Trainer, TrainingArguments  # noqa: E402


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x, labels=None):
        out = self.net(x)
        loss = None if labels is None else torch.nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


class Pairs(torch.utils.data.Dataset):
    def __init__(self):
        self.x, self.y = make_data()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


training_args = TrainingArguments(
    output_dir=out_dir + "/trainer", use_cpu=True, per_device_train_batch_size=8,
    max_steps=6, learning_rate=0.01, seed=0, report_to=[], save_strategy="no",
    logging_strategy="steps", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    ddp_find_unused_parameters=False)
trainer = Trainer(model=Regressor(), args=training_args, train_dataset=Pairs())
assert trainer.args.world_size == 2, trainer.args.world_size
result = trainer.train()
losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
save(out_dir, trainer.model.named_parameters(),
     {"losses": losses, "steps": trainer.state.global_step,
      "train_loss": result.training_loss})
