"""Pipeline checkpoints through ``torch.distributed.checkpoint`` (DCP), keyed by global names, so they move between
layouts: another stage count or split, another replica count, sharded or not.

(No Lightning here: :mod:`lightning_async.strategies.checkpoints` decides when every rank saves and loads.)

Every rank saves, in parallel, one flat dict of what it holds (DCP writes each key once, however many replicas hold
it, and one file per rank):

``model/<name>``                 the newest weights (the module's state dict, global names)
``version/<name>``               the weight version one update behind the newest (2BW's older one)
``version<a>/<name>``            the version ``a >= 2`` updates behind (a stage ``a`` or more steps stale: PipeDream)
``optimizer/<name>/<key>``       the optimizer's state of parameter ``<name>`` (every name a tied weight has)
``optimizer_group/<name>``       the hyperparameters of that parameter's group (lr, betas, weight decay, ...)
``correction/<buffer>/<name>``   a correction's per-parameter buffers (EF's previous update, ...)
``runtime``, ``trainer``         the runtime's counters and everything else Lightning saves (rank 0's)

On load a rank asks for the keys of the parameters it holds now (under the sharded optimizer: the optimizer state and
buffers of its own share), whatever layout wrote them, and gets back a checkpoint dict in its own layout's form.
Why not ``torch.distributed.checkpoint.state_dict.get_state_dict``: it keys an optimizer by the module it is given,
and our stages hold pieces of a module under their global names, with two weight versions beside it.

Under FSDP inside a stage (``fsdp=True``) the weights, versions, optimizer state and buffers are ``DTensor`` shards:
DCP writes each replica's shard under the same global key, and a sharded run loads into targets sharded as its own
parameters, so a checkpoint moves between FSDP and unsharded runs of any replica count.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence

import torch
import torch.distributed.checkpoint as dcp

MODEL, VERSION, OPTIMIZER, GROUP, CORRECTION = "model/", "version/", "optimizer/", "optimizer_group/", "correction/"
RUNTIME, TRAINER = "runtime", "trainer"
_GROUPS = "lightning_async_optimizer_groups"  # (in ``trainer``: how many parameter groups the saving rank had)
#: the keys of a Lightning checkpoint dict that are saved by name (everything else goes into ``trainer``)
_BY_NAME = ("state_dict", "optimizer_states", "pipeline_runtime", "pipeline")


def _blob(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unblob(data: bytes):
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def parameter_names(module: torch.nn.Module) -> dict[int, list[str]]:
    """``id(parameter) -> every name it has in module`` (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def slot_age(slot: int, batches_done: int, versions: int) -> int:
    """How many updates the version in ``slot`` lacks against the newest, in a drained pipeline after
    ``batches_done`` batches (the ring of :class:`~lightning_async.optim.clock.PieceClock`: slot ``b % versions``
    holds ``V(b)``, and the next batches ``batches_done .. batches_done + versions - 1`` read them in turn, the last
    one the newest)."""
    first = batches_done + (slot - batches_done) % versions  # the batch that reads this slot next
    return batches_done + versions - 1 - first


def version_prefix(age: int) -> str:
    """The key prefix of the version ``age >= 1`` updates behind the newest (``version/``: one, as 2BW saves it)."""
    return VERSION if age == 1 else f"version{age}/"


def version_groups(runtime: dict) -> list[dict]:
    """The weight versions of a runtime state (``PipelineRuntime.state_dict``) per update group: each a dict of
    ``slots`` and ``newest_slot`` (one group: the state itself)."""
    return runtime.get("update_groups") or [runtime]


def _optimizer_order(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def rank_state(checkpoint: dict, optimizer, params: Sequence[torch.Tensor], names: dict[int, list[str]],
               with_trainer: bool) -> dict:
    """The flat dict this rank saves: ``checkpoint`` (Lightning's, with ``pipeline_runtime``) by global names.
    ``params``: the runtime's parameters (the order of its slots); ``with_trainer``: this rank writes ``trainer``."""
    flat: dict = {MODEL + k: v for k, v in checkpoint["state_dict"].items()}
    order = _optimizer_order(optimizer) if optimizer is not None else []
    for saved in checkpoint.get("optimizer_states", [])[:1]:
        for index, state in saved["state"].items():
            for name in names[id(order[int(index)])]:
                flat.update({f"{OPTIMIZER}{name}/{key}": value for key, value in state.items()})
        for group in saved["param_groups"]:
            hyper = _blob({k: v for k, v in group.items() if k != "params"})
            for index in group["params"]:
                flat.update({GROUP + name: hyper for name in names[id(order[index])]})
    runtime = checkpoint.get("pipeline_runtime")
    if runtime is not None:
        start = 0
        for group in version_groups(runtime):  # (each group's slots hold a run of ``params``, in order)
            count = len(group["slots"][0])
            for s, slot in enumerate(group["slots"]):
                if s != group["newest_slot"]:
                    prefix = version_prefix(slot_age(s, runtime["batches_done"], len(group["slots"])))
                    flat.update({prefix + name: t for p, t in zip(params[start:start + count], slot) for name in names[id(p)]})
            start += count
        settings = {}
        for key, value in (runtime.get("correction") or {}).items():
            if isinstance(value, list):
                flat.update({f"{CORRECTION}{key}/{name}": t for p, t in zip(params, value) if t is not None
                             for name in names[id(p)]})
            else:
                settings[key] = value
        if with_trainer:
            flat[RUNTIME] = _blob({"schedule": runtime["schedule"], "batches_done": runtime["batches_done"],
                                   "versions": [len(g["slots"]) for g in version_groups(runtime)], "correction": settings})
    if with_trainer:
        rest = {k: v for k, v in checkpoint.items() if k not in _BY_NAME}
        rest[_GROUPS] = len(optimizer.param_groups) if optimizer is not None else 0
        flat[TRAINER] = _blob(rest)
    return flat


def _per_group_schedulers(schedulers: list[dict], groups: list[dict], saved_groups: int) -> list[dict]:
    """Learning-rate scheduler states for this rank's parameter groups. A scheduler keeps some entries per group
    (``base_lrs``, ``_last_lr``, ``lr_lambdas``, ...) and the states come from rank 0, whose groups may differ in
    number and rates from this rank's (another stage, another layout). ``base_lrs`` and ``_last_lr`` are rebuilt
    from this rank's groups (their ``initial_lr`` and ``lr`` come from the checkpoint, per parameter); other
    per-group entries are repeated when the count differs; every other entry is kept."""
    out = []
    for state in schedulers:
        state = dict(state)
        for key, value in state.items():
            if key == "base_lrs":  # always this rank's own: the saving rank's groups may hold other rates
                state[key] = [g.get("initial_lr", g.get("lr")) for g in groups]
            elif key == "_last_lr":
                state[key] = [g.get("lr") for g in groups]
            elif isinstance(value, list) and len(value) == saved_groups != len(groups):
                state[key] = [value[0]] * len(groups)
        out.append(state)
    return out


def save(flat: dict, directory: str) -> None:
    """Every rank, together (one file per rank; a key several ranks hold is written once)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save(flat, storage_writer=dcp.FileSystemWriter(directory))


def saved_keys(directory: str) -> dict:
    """The checkpoint's keys and their storage metadata (read by each rank on its own)."""
    return dcp.FileSystemReader(directory).read_metadata().state_dict_metadata


def _keys_by_parameter(keys) -> dict[tuple[str, str], list[str]]:
    """``(OPTIMIZER or CORRECTION, parameter name) -> its keys`` (``optimizer/<name>/<key>``,
    ``correction/<buffer>/<name>``)."""
    out: dict[tuple[str, str], list[str]] = {}
    for key in keys:
        if key.startswith(OPTIMIZER):
            out.setdefault((OPTIMIZER, key[len(OPTIMIZER):].rsplit("/", 1)[0]), []).append(key)
        elif key.startswith(CORRECTION):
            out.setdefault((CORRECTION, key[len(CORRECTION):].split("/", 1)[1]), []).append(key)
    return out


def _first_saved(prefix: str, aliases: Sequence[str], keys) -> str | None:
    return next((a for a in aliases if prefix + a in keys), None)


def _empty_like_saved(meta, like: torch.Tensor | None = None) -> torch.Tensor | None:
    """A tensor to load a saved key into: sharded as ``like`` (an FSDP parameter) where it has its shape (DCP then reads
    only this rank's shard), else whole."""
    if isinstance(meta, dcp.TensorStorageMetadata):
        if like is not None and _is_sharded(like) and tuple(meta.size) == tuple(like.shape):
            return torch.empty_like(like, dtype=meta.properties.dtype)
        return torch.empty(meta.size, dtype=meta.properties.dtype)
    return None  # bytes: replaced by the loaded object


def _is_sharded(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh")  # a DTensor (FSDP2 inside a stage)


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """A target for ``t``'s saved value: ``t``'s own sharding under FSDP, else a whole tensor on the CPU."""
    return torch.empty_like(t) if _is_sharded(t) else torch.empty(t.shape, dtype=t.dtype)


class RankRequest:
    """What one rank loads and how its answer becomes a Lightning checkpoint dict of this rank's layout.

    Args:
        keys: :func:`saved_keys` of the checkpoint.
        state_dict: this rank's module state dict (the names and shapes it needs).
        optimizer: this rank's optimizer (its groups and parameter order), or ``None`` (evaluation).
        params: the runtime's parameters, in slot order; ``versions``: its weight slots (an int), or per update group
            ``(parameters, slots)`` (the runtime's ``version_layout``: each group a run of ``params``).
        names: :func:`parameter_names` of this rank's module; ``owned``: per parameter, whether this rank keeps its
            optimizer state and correction buffers (``None``: all).
    """

    def __init__(self, keys, state_dict: dict, optimizer, params: Sequence[torch.Tensor],
                 versions: int | Sequence[tuple[int, int]], names: dict[int, list[str]],
                 owned: Sequence[bool] | None = None) -> None:
        self.keys, self.optimizer, self.params, self.names = keys, optimizer, list(params), names
        self.layout = [(len(self.params), versions)] if isinstance(versions, int) else [tuple(g) for g in versions]
        per_param = [n for count, n in self.layout for _ in range(count)]
        self.owned = [True] * len(self.params) if owned is None else list(owned)
        missing = [k for k in state_dict if MODEL + k not in keys]
        if missing:
            raise ValueError(
                f"the checkpoint has no weights for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}: it "
                "was saved from another model. Resume with the model it was saved from."
            )
        self.flat: dict = {MODEL + k: _empty_like(v) for k, v in state_dict.items()}
        for key in (RUNTIME, TRAINER):
            if key in keys:
                self.flat[key] = None
        self.state_keys = state_dict.keys()
        per_parameter = _keys_by_parameter(keys)
        self.optimizer_keys: dict[int, tuple[str, list[str]]] = {}  # parameter index -> (saved name, its state keys)
        for i, p in enumerate(self.params):
            aliases = names[id(p)]
            for age in range(1, per_param[i]):
                if (alias := _first_saved(version_prefix(age), aliases, keys)) is not None:
                    self.flat[version_prefix(age) + alias] = _empty_like(p)
            if alias := _first_saved(GROUP, aliases, keys):
                self.flat[GROUP + alias] = None
            if not self.owned[i]:
                continue
            for kind in (OPTIMIZER, CORRECTION):
                alias = next((a for a in aliases if (kind, a) in per_parameter), None)
                if alias is None:
                    continue
                wanted = per_parameter[kind, alias]
                self.flat.update({k: _empty_like_saved(keys[k], like=p) for k in wanted})
                if kind == OPTIMIZER:
                    self.optimizer_keys[id(p)] = (alias, wanted)

    def load(self, directory: str) -> None:
        """Every rank, together."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(self.flat, storage_reader=dcp.FileSystemReader(directory))

    # ---- the answer in this rank's form ---------------------------------------------------------------------
    def _of(self, prefix: str, p: torch.Tensor):
        alias = _first_saved(prefix, self.names[id(p)], self.flat)
        return None if alias is None else self.flat[prefix + alias]

    def checkpoint(self) -> dict:
        """Lightning's checkpoint dict for this rank (``pipeline_runtime`` included when the runtime state was saved)."""
        out = _unblob(self.flat[TRAINER]) if self.flat.get(TRAINER) is not None else {}
        saved_groups = out.pop(_GROUPS, 0)
        out["state_dict"] = {k: self.flat[MODEL + k] for k in self.state_keys}
        if self.optimizer is not None:
            out["optimizer_states"] = [self._optimizer_state()]
            groups = out["optimizer_states"][0]["param_groups"]
            out["lr_schedulers"] = _per_group_schedulers(out.get("lr_schedulers", []), groups, saved_groups)
        if self.flat.get(RUNTIME) is not None:
            out["pipeline_runtime"] = self._runtime_state(_unblob(self.flat[RUNTIME]))
        return out

    def _optimizer_state(self) -> dict:
        order = _optimizer_order(self.optimizer)
        state: dict = {}
        for index, p in enumerate(order):
            if id(p) in self.optimizer_keys:
                alias, wanted = self.optimizer_keys[id(p)]
                state[index] = {k[len(OPTIMIZER) + len(alias) + 1:]: self.flat[k] for k in wanted}
        groups, start = [], 0
        for group in self.optimizer.param_groups:
            indices = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            hyper = next((self._of(GROUP, p) for p in group["params"] if self._of(GROUP, p) is not None), None)
            saved = _unblob(hyper) if hyper is not None else {k: v for k, v in group.items() if k != "params"}
            groups.append({**saved, "params": indices})
        return {"state": state, "param_groups": groups}

    def _runtime_state(self, saved: dict) -> dict:
        """The slots in this rank's ring: the version ``a`` updates behind the newest where the next batches read it.
        A version the saving layout did not keep (it was less stale there) is the stalest one it kept (a flushing
        run's: the newest)."""
        batches, groups, start = saved["batches_done"], [], 0
        for count, n in self.layout:
            params = self.params[start:start + count]
            start += count
            by_age = [[self._of(MODEL, p) for p in params]]
            for age in range(1, n):
                kept = [self._of(version_prefix(age), p) for p in params]
                by_age.append([k if k is not None else older for k, older in zip(kept, by_age[-1])])
            groups.append({"slots": [by_age[slot_age(slot, batches, n)] for slot in range(n)],
                           "newest_slot": next(slot for slot in range(n) if slot_age(slot, batches, n) == 0)})
        buffers = {key[len(CORRECTION):].split("/", 1)[0] for key in self.flat if key.startswith(CORRECTION)}
        correction = dict(saved["correction"])
        correction.update({b: [self._of(f"{CORRECTION}{b}/", p) for p in self.params] for b in buffers})
        versions = groups[0] if len(groups) == 1 else {"update_groups": groups}
        return {"schedule": saved["schedule"], "batches_done": saved["batches_done"], **versions,
                "correction": correction or None}


def consolidated_weights(directory: str) -> dict[str, torch.Tensor]:
    """The whole model's newest weights (the plain module's state dict) from a DCP pipeline checkpoint, on one process."""
    keys = saved_keys(directory)
    flat = {k: _empty_like_saved(v) for k, v in keys.items() if k.startswith(MODEL)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(flat, storage_reader=dcp.FileSystemReader(directory))
    return {k[len(MODEL):]: v for k, v in flat.items()}


def trainer_state(directory: str) -> dict:
    """What Lightning saved beside the weights (hyperparameters, loops, callbacks, ...), on one process."""
    flat = {TRAINER: None}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(flat, storage_reader=dcp.FileSystemReader(directory))
    return _unblob(flat[TRAINER])


def is_distributed_checkpoint(directory: str) -> bool:
    """Whether ``directory`` holds a checkpoint written by ``torch.distributed.checkpoint``."""
    return os.path.isfile(os.path.join(os.fspath(directory), ".metadata"))
