"""accelerate on the CPU: ``gradsync.torch.distributed.init()`` before the
Accelerator (accelerate would turn backend="gradsync" into gloo and raise);
the Accelerator then uses the group it finds."""
import torch
from _common import args, make_data, make_model, save

backend, out_dir = args()
if backend == "gradsync":
    import gradsync.torch.distributed as gtd
    gtd.init()

from accelerate import Accelerator  # noqa: E402

accelerator = Accelerator(cpu=True)
assert accelerator.num_processes == 2, accelerator.num_processes
model = make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x, y = make_data()
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for _epoch in range(2):
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
gathered = accelerator.gather(torch.tensor([float(accelerator.process_index)]))
accelerator.wait_for_everyone()
save(out_dir, accelerator.unwrap_model(model).named_parameters(),
     {"losses": losses, "gathered": gathered.tolist(), "steps": len(losses)})
accelerator.end_training()
