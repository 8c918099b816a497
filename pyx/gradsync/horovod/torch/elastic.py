"""horovod.torch.elastic on gradsync: TorchState, ElasticSampler and run().

``@hvd.elastic.run`` wraps a training function: ``state.sync()`` first (rank
0's model, optimizer and attributes everywhere); on HorovodInternalError the
state goes back to its last ``commit()``, the world is re-formed (shutdown
and init on every rank: shrunk after a lost rank or grown by newcomers on a
world joined from singletons, the same MPI world under mpiexec; module
gradsync.horovod.elastic says how) and the function runs again.
"""
import copy

import torch

from gradsync.horovod import basics
from gradsync.horovod.elastic import (  # noqa: F401
    MISSING,
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    reset_world,
    run_fn,
)
from gradsync.horovod.torch.functions import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]


def run(func):
    """Horovod's ``@hvd.elastic.run`` (module docstring)."""
    return run_fn(func, reset_world)


class TorchState(ObjectState):
    """State of a model, an optimizer and other attributes
    (``TorchState(model, optimizer, epoch=0, batch=0)``)."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        self.model, self.optimizer = model, optimizer
        self._saved_model = self._saved_optimizer = None
        super().__init__(bcast_object=broadcast_object, get_rank=basics.rank, **kwargs)
        self.save()

    def save(self):
        if self.model is not None:
            self._saved_model = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._saved_optimizer = copy.deepcopy(self.optimizer.state_dict())
        super().save()

    def restore(self):
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)
        if self.optimizer is not None and self._saved_optimizer is not None:
            self.optimizer.load_state_dict(self._saved_optimizer)
        super().restore()

    def sync(self):
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        super().sync()


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ElasticSampler: this rank's share of a dataset's indices
    (shuffled by ``seed`` and the epoch), minus the ones already processed
    this epoch (``record_batch``/``record_indices``), so training resumes
    where the last commit left it. State: ``state_dict()``/``load_state_dict``."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices = set()
        self.num_replicas = self.rank = 0
        self.remaining_indices = []
        self.num_samples = self.total_size = 0
        self.reset()

    def set_epoch(self, epoch):
        """A new epoch: nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Marks the indices of batch ``batch_idx`` of this epoch as processed."""
        mine = self._indices()[batch_idx * batch_size:(batch_idx + 1) * batch_size]
        self.record_indices(mine)

    def record_indices(self, indices):
        self.processed_indices.update(int(i) for i in indices)

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def reset(self):
        """Re-reads the world (rank, size) and re-splits what is left."""
        self.num_replicas = basics.size() if basics.is_initialized() else 1
        self.rank = basics.rank() if basics.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=g).tolist()
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = -(-len(self.remaining_indices) // self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def _indices(self):
        indices = list(self.remaining_indices)
        if indices:
            indices += indices[:self.total_size - len(indices)]
        return indices[self.rank:self.total_size:self.num_replicas]

    def __iter__(self):
        return iter(self._indices())

    def __len__(self):
        return self.num_samples
