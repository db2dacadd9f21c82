"""PEFT adapters in luopan, tied to the base model they were trained on (the check ModelScope makes on a patch).

    import luopan.peft
    luopan.peft.save_adapter(repo, "lora-a", step, peft_model)      # adapter weights + config + base fingerprint
    luopan.peft.load_adapter(repo, "lora-a", peft_model)            # BaseMismatchError on another base
    luopan.peft.export_adapter(repo, "lora-a", "out/")              # adapter_model.safetensors + adapter_config.json

An adapter checkpoint is a state tree ``{"model": <adapter weights, PEFT's names>, "peft": {"adapter_name",
"config", "base_fingerprint"}}`` (plus whatever else the caller saves beside it). ``base_fingerprint`` is
``luopan.torch.fingerprint`` of the frozen base model under its own parameter names (the names it has before PEFT
wraps it): a hash over every base tensor's bytes, so a base with the same names and shapes but other weights is a
different base. Tensor digests are cached while the base is unchanged, so saving again costs one pass over names.
"""

from __future__ import annotations

import json
import os
import secrets
from typing import Any

from .errors import BaseMismatchError, CheckpointNotFoundError, OutputPathError, UsageError
from .torch.fingerprint import fingerprint
from .tree import unflatten

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _adapter_name(model: Any, adapter_name: str | None) -> str:
    name = adapter_name or getattr(model, "active_adapter", None) or "default"
    if name not in model.peft_config:
        raise UsageError(f"the model has no adapter {name!r}; it has {', '.join(sorted(model.peft_config))}")
    return name


def base_state(model: Any) -> dict[str, Any]:
    """The frozen base model's tensors under the names they have without PEFT: adapter tensors (any key component
    naming an adapter) are left out, and PEFT's wrapper components ``base_layer`` and ``original_module`` dropped."""
    if not is_peft_model(model):
        return model.state_dict()
    adapters = set(model.peft_config)
    out: dict[str, Any] = {}
    for key, tensor in model.get_base_model().state_dict().items():
        parts = key.split(".")
        if adapters.intersection(parts):
            continue
        out[".".join(p for p in parts if p not in ("base_layer", "original_module"))] = tensor
    return out


def base_fingerprint(model: Any) -> str:
    """``luopan.torch.fingerprint`` of the base model under a PEFT model (or of a plain model): equal for the base
    before and after ``get_peft_model`` wraps it, different for any other weights."""
    return fingerprint(base_state(model))


def adapter_state(model: Any, adapter_name: str | None = None) -> dict[str, Any]:
    """``{"model": adapter weights, "peft": {adapter_name, config, base_fingerprint}}`` of a PEFT model."""
    from peft import get_peft_model_state_dict

    if not is_peft_model(model):
        raise UsageError(f"{type(model).__name__} is not a PEFT model (peft.PeftModel): save it with repo.save")
    name = _adapter_name(model, adapter_name)
    weights = {k: v.detach() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
    return {"model": weights, "peft": {"adapter_name": name, "config": model.peft_config[name].to_dict(),
                                        "base_fingerprint": base_fingerprint(model)}}


def check_base(model: Any, record: dict[str, Any], where: str) -> None:
    """BaseMismatchError, naming both fingerprints, when ``model``'s base is not the one ``record`` was saved on."""
    saved = record.get("base_fingerprint")
    live = base_fingerprint(model)
    if saved != live:
        raise BaseMismatchError(
            f"{where} is an adapter for base {saved}, but this model's base is {live}: load it onto the base model "
            "it was trained on (same weights, not only the same names and shapes)")


def apply_adapter(model: Any, tree: dict[str, Any], where: str, adapter_name: str | None = None) -> None:
    """Load an adapter tree (``adapter_state``'s shape) into a PEFT model after checking its base."""
    from peft import set_peft_model_state_dict

    if not isinstance(tree.get("peft"), dict) or "model" not in tree:
        raise UsageError(f"{where} is not an adapter checkpoint (it has no 'peft' record): load it with repo.load")
    if not is_peft_model(model):
        raise UsageError(f"{where} is a PEFT adapter; wrap the base model first (peft.get_peft_model or "
                         "PeftModel) and pass that")
    check_base(model, tree["peft"], where)
    name = _adapter_name(model, adapter_name or tree["peft"].get("adapter_name"))
    result = set_peft_model_state_dict(model, tree["model"], adapter_name=name)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise UsageError(f"{where}: the model has no place for {len(unexpected)} adapter tensors (e.g. "
                         f"{unexpected[0]!r}): its adapter config differs from the saved one")


def save_adapter(repo: Any, run: str, step: int, model: Any, *, adapter_name: str | None = None,
                 extra: dict[str, Any] | None = None, **save_options: Any) -> Any:
    """``repo.save`` of the adapter of a PEFT model with its config and base fingerprint (plus ``extra``
    top-level entries such as an optimizer state). Returns the CheckpointInfo."""
    state = adapter_state(model, adapter_name)
    clash = set(extra or ()) & set(state)
    if clash:
        raise UsageError(f"extra= may not use the names {sorted(clash)}: the adapter uses them")
    return repo.save(run, step, {**state, **(extra or {})}, **save_options)


def load_adapter(repo: Any, run: str, model: Any, step: int | None = None, *,
                 adapter_name: str | None = None) -> dict[str, Any]:
    """Load the adapter of checkpoint ``step`` (latest when None) into ``model``, refusing another base
    (BaseMismatchError naming both fingerprints) before any weight changes. Returns the whole loaded tree."""
    tree = repo.load(run, step)
    apply_adapter(model, tree, f"run {run!r} step {step if step is not None else repo.steps(run)[-1]}",
                  adapter_name)
    return tree


def peft_record(repo: Any, run: str, step: int | None = None) -> dict[str, Any] | None:
    """The ``peft`` record of a checkpoint (read from its manifest; no tensor is read), or None."""
    m = repo.manifest(run, step)
    node = next((v for k, v in m.tree.get("dict", []) if k == "peft"), None)
    if node is None:
        return None

    def no_tensor(i: int) -> Any:
        raise UsageError(f"run {run!r} step {m.step}: its 'peft' record holds a tensor; it was not written by "
                         "luopan.peft")

    record = unflatten(node, no_tensor, f"run {run!r} step {m.step}")
    return record if isinstance(record, dict) else None


def adapter_config_json(config: dict[str, Any]) -> dict[str, Any]:
    """The config as PEFT's ``save_pretrained`` writes it: sets as lists, enums as their values."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, (set, frozenset)):
            v = sorted(v)
        out[k] = getattr(v, "value", v)
    return out


def export_adapter(repo: Any, run: str, out_dir: str | os.PathLike[str], step: int | None = None) -> dict[str, Any]:
    """Write an adapter checkpoint as a directory ``PeftModel.from_pretrained(base, out_dir)`` loads:
    ``adapter_model.safetensors`` and ``adapter_config.json``. Returns {"path", "tensors", "bytes",
    "base_fingerprint"}."""
    record = peft_record(repo, run, step)
    m = repo.manifest(run, step)
    if record is None or not isinstance(record.get("config"), dict):
        raise CheckpointNotFoundError(f"run {run!r} step {m.step} is not an adapter checkpoint (no 'peft' record): "
                                      "export it with `luopan export` instead")
    out = os.fspath(out_dir)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(exc.errno or 5, f"cannot create the adapter directory {out}: "
                                              f"{exc.strerror or exc}") from None
    info = repo.export(run, os.path.join(out, ADAPTER_WEIGHTS), m.step, subtree="model")
    path = os.path.join(out, ADAPTER_CONFIG)
    tmp = os.path.join(out, f".{ADAPTER_CONFIG}.tmp-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(adapter_config_json(record["config"]), f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise OutputPathError(exc.errno or 5, f"cannot write {path}: {exc.strerror or exc}") from None
    return {"path": out, "tensors": info["tensors"], "bytes": info["bytes"],
            "base_fingerprint": record.get("base_fingerprint")}
