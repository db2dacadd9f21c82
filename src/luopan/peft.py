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
from typing import Any

from ._files import write_atomic
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
    """The frozen base model's tensors under the names they have without PEFT. Found from PEFT's own modules, not
    from names: every tensor of an adapter container (a tuner layer's ``adapter_layer_names`` and
    ``other_param_names``, a wrapper's ``modules_to_save`` or trainable-token delta) is left out, and a wrapper's
    path to the module it wraps (``base_layer``, ``original_module``, ``token_adapter.base_layer``) is dropped."""
    if not is_peft_model(model):
        return model.state_dict()
    base = model.get_base_model()
    drop, rename = _peft_layout(base)
    out: dict[str, Any] = {}
    for key, tensor in base.state_dict().items():
        if key.startswith(drop):
            continue
        for _ in range(64):  # wrappers may nest: rewrite the longest wrapper prefix until none applies
            hit = next(((a, b) for a, b in rename if key.startswith(a)), None)
            if hit is None:
                break
            key = hit[1] + key[len(hit[0]):]
        out[key] = tensor
    return out


def _peft_layout(base: Any) -> tuple[tuple[str, ...], list[tuple[str, str]]]:
    """(key prefixes of adapter tensors, [(wrapper prefix, the wrapped module's prefix)] longest first)."""
    import torch
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # older PEFT: modules_to_save is the only wrapper
        AuxiliaryTrainingWrapper = ModulesToSaveWrapper  # noqa: N806
    drop: list[str] = []
    rename: list[tuple[str, str]] = []
    for name, module in base.named_modules():
        pre = f"{name}." if name else ""
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            for attr in (*getattr(module, "adapter_layer_names", ()), *getattr(module, "other_param_names", ())):
                drop.append(f"{pre}{attr}.")
        if isinstance(module, BaseTunerLayer) and isinstance(getattr(module, "base_layer", None), torch.nn.Module):
            rename.append((f"{pre}base_layer.", pre))
        if isinstance(module, AuxiliaryTrainingWrapper):
            wrapped = getattr(module, "original_module", None)
            rel = next((r for r, m in module.named_modules() if r and m is wrapped), None)
            if rel:
                rename.append((f"{pre}{rel}.", pre))
    return tuple(drop), sorted(rename, key=lambda pair: -len(pair[0]))


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
    if not isinstance(saved, str):
        raise BaseMismatchError(f"{where} records no base fingerprint, so its base cannot be checked: it was not "
                                "saved by luopan.peft / luopan.hf")
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
    _check_config(model.peft_config[name].to_dict(), tree["peft"].get("config") or {}, where)
    result = set_peft_model_state_dict(model, tree["model"], adapter_name=name)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise UsageError(f"{where}: the model has no place for {len(unexpected)} adapter tensors (e.g. "
                         f"{unexpected[0]!r}): its adapter config differs from the saved one")


def _check_config(live: dict[str, Any], saved: dict[str, Any], where: str) -> None:
    """The settings that decide which adapter tensors exist and what they mean must agree: otherwise some would stay
    freshly initialised (a partial load) or be scaled differently."""
    def norm(v: Any) -> Any:
        v = getattr(v, "value", v)
        return sorted(v) if isinstance(v, (set, frozenset, list, tuple)) else v

    keys = ("peft_type", "r", "lora_alpha", "target_modules", "modules_to_save", "use_dora", "use_rslora",
            "trainable_token_indices", "layers_to_transform")
    bad = [f"{k}: saved {norm(saved[k])!r}, model {norm(live[k])!r}" for k in keys
           if k in saved and k in live and norm(saved[k]) != norm(live[k])]
    if bad:
        raise UsageError(f"{where} is an adapter of another configuration than this model's ({'; '.join(bad)}): "
                         "wrap the base with the saved config (luopan.peft.peft_record(...)['config'])")


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
    (BaseMismatchError naming both fingerprints) before any weight changes. Returns the adapter weights that were
    loaded, under PEFT's names (``get_peft_model_state_dict``'s keys); whatever else was saved beside them (an
    optimizer state passed as ``extra=``) is ``repo.load(run, step)``'s."""
    tree = repo.load(run, step)
    apply_adapter(model, tree, f"run {run!r} step {step if step is not None else repo.steps(run)[-1]}",
                  adapter_name)
    return tree["model"]


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
    m = repo.manifest(run, step)  # resolved once: the config and the weights come from one step
    record = peft_record(repo, run, m.step)
    if record is None or not isinstance(record.get("config"), dict):
        raise CheckpointNotFoundError(f"run {run!r} step {m.step} is not an adapter checkpoint (no 'peft' record): "
                                      "export it with `luopan export` instead")
    out = os.fspath(out_dir)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(exc.errno or 5, f"cannot create the adapter directory {out}: "
                                              f"{exc.strerror or exc}") from None
    info = repo.export(run, m.step, os.path.join(out, ADAPTER_WEIGHTS), subtree="model")
    data = json.dumps(adapter_config_json(record["config"]), indent=2, sort_keys=True).encode()
    write_atomic(os.path.join(out, ADAPTER_CONFIG), data)
    return {"path": out, "tensors": info["tensors"], "bytes": info["bytes"],
            "base_fingerprint": record.get("base_fingerprint")}
