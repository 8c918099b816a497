"""Lightning DDP on the CPU: DDPStrategy(process_group_backend="gradsync")
after ``import gradsync.torch.distributed`` (which registers the name);
Lightning creates the group itself. Logged values use sync_dist (an AVG
all-reduce); Lightning's barrier goes through a gloo group it creates on the
side, which needs the MASTER_ADDR/MASTER_PORT torchrun sets."""
import lightning as L
import torch
from _common import args, make_data, make_model, save
from lightning.pytorch.strategies import DDPStrategy

backend, out_dir = args()
if backend == "gradsync":
    import gradsync.torch.distributed  # noqa: F401  (registers "gradsync")


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.losses = []

    def training_step(self, batch, batch_idx):
        xb, yb = batch
        loss = torch.nn.functional.mse_loss(self.net(xb), yb)
        self.log("train_loss", loss, sync_dist=True, on_step=True, reduce_fx="mean")
        self.losses.append(float(self.trainer.callback_metrics.get("train_loss", torch.nan)))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


x, y = make_data()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
module = Module()
trainer = L.Trainer(accelerator="cpu", devices=2, num_nodes=1, max_epochs=2,
                    strategy=DDPStrategy(process_group_backend=backend),
                    enable_checkpointing=False, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, deterministic=True,
                    default_root_dir=out_dir + "/lightning")
trainer.fit(module, loader)
trainer.strategy.barrier()
save(out_dir, module.net.named_parameters(),
     {"losses": module.losses, "steps": trainer.global_step,
      "sync_loss": float(trainer.callback_metrics["train_loss"])})
