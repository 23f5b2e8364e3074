"""Validate the whole config once, in the launcher, before any worker starts.

Every error names the key, the value and what is allowed, in one line (``errors.ConfigError``). The keys of
``trainer``, ``optimizer``, ``schedule``, ``model`` and the data loader are checked here; every group chosen
by a ``_target_`` validates its own section through the one signature of ``errors.py``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
from collections.abc import Callable
from typing import Any

from hydra.utils import get_object

from distributed.etcd import TLS_SCHEME, Tls, TlsFileError
from distributed.etcd import parse as parse_store
from engine.launchers import slurm_task, under_external_launcher
from engine.scope import validate_scope
from errors import ConfigError
from errors import is_int as _is_int
from errors import is_number as _is_num
from errors import require as _check

SCHEDULES = ("cosine", "poly", "step")
OPTIMIZERS = ("sgd", "momentum", "lars")
DEVICES = ("auto", "cpu", "cuda")
NETDEV_DIR = "/sys/class/net"
TARGET_GROUPS = ("data", "amp", "logger", "sync", "straggler")  # groups that name what builds them


def to_plain(cfg: Any) -> dict[str, Any]:
    """Resolve a composed DictConfig into a plain dict; a required (``???``) key left unset is an error."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(missing[0], "???", "a value: this key is required (set it on the command line)")
    plain = OmegaConf.to_container(cfg, resolve=True)
    plain.pop("hydra", None)
    return plain


def prepare(cfg: Any) -> dict[str, Any]:
    """Resolve and validate a composed config; the one place a config becomes what workers receive."""
    plain = to_plain(cfg)
    validate(plain)
    return plain


def check_override_keys(overrides: list[str], conf_dir: str) -> None:
    """Reject a key override that names no key of the config, with the nearest key, before any composition or
    worker: Hydra rejects ``trainer.epoch=3`` without naming the key meant, and takes ``+trainer.epoch=3`` (the
    fix it suggests) silently, so a typo would be ignored. Keys are looked up in the config composed from the
    same group choices (the first choice of a group swept with ``-m``); ``hydra.*`` keys are Hydra's own."""
    import difflib

    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if "=" in o and o[0] != "-"])
    except Exception:  # noqa: BLE001 - malformed overrides are Hydra's to report
        return
    groups = {entry.name for entry in os.scandir(conf_dir) if entry.is_dir()}
    choices, keys = [], []
    for o in parsed:
        if o.key_or_group in groups:
            first = next(o.sweep_string_iterator()) if o.is_sweep_override() else o.value()
            choices.append(f"{o.get_key_element()}={first}")
        elif not o.is_delete() and o.key_or_group.split(".")[0].split("/")[0] != "hydra":  # (hydra/launcher=...)
            keys.append(o)
    if not keys:
        return
    try:
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            reference = compose(config_name="train", overrides=choices)
    except Exception:  # noqa: BLE001 - an unknown group option is Hydra's to report (it lists the options)
        return
    known = [k for k in _leaf_keys(OmegaConf.to_container(reference, resolve=False)) if "._" not in f".{k}"]
    for o in keys:
        if not _has_key(reference, o.key_or_group):
            near = difflib.get_close_matches(o.key_or_group, known, n=1, cutoff=0.6)
            hint = f"did you mean {near[0]}?" if near else "all keys: .venv/bin/python train.py --cfg job"
            value = o.input_line.split("=", 1)[1] if o.is_sweep_override() else o.value()
            raise ConfigError(o.key_or_group, value, f"a key of the config ({hint})")


def _has_key(cfg: Any, key: str) -> bool:
    """Whether the dotted ``key`` names a key of ``cfg``, a required (``???``) one included."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    absent = object()
    try:
        return OmegaConf.select(cfg, key, default=absent, throw_on_missing=True) is not absent
    except MissingMandatoryValue:
        return True


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf of a nested dict."""
    if not isinstance(node, dict) or not node:
        return [prefix]
    return [leaf for key, value in node.items() for leaf in _leaf_keys(value, f"{prefix}.{key}" if prefix else key)]


def world_size_of(cfg: dict[str, Any]) -> int:
    """The number of worker processes this run will have: its external launcher's (torchrun's, srun's tasks), else
    the local launcher's ``trainer.nproc``. A process that joins a running world (``trainer.join``) is checked against
    that world's first size, the one its ranks and batch were set for."""
    t = cfg["trainer"]
    joined = os.path.join(t.get("run_dir") or "", "join.json")
    if t.get("join") and os.path.isfile(joined):
        with open(joined) as f:
            return int(json.load(f)["initial_size"])
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if slurm_task():
        return int(os.environ["SLURM_NTASKS"])
    return cfg["trainer"]["nproc"]


def _check_gpus(t: dict[str, Any]) -> None:
    """``trainer.device=cuda`` needs a GPU; and the local launcher's ``trainer.nproc`` processes, on CUDA (``cuda``, or
    ``auto`` where there is a GPU), one GPU each: NCCL refuses two ranks on one GPU (a duplicate GPU)."""
    import torch

    gpus = torch.cuda.device_count()
    if t["device"] == "cuda":
        _check(gpus > 0, "trainer.device", t["device"], "auto or cpu: no CUDA device here")
    launched_here = not under_external_launcher()
    if gpus and launched_here:
        _check(
            t["nproc"] <= gpus,
            "trainer.nproc",
            t["nproc"],
            f"at most {gpus} on CUDA, one process per GPU (NCCL): this machine has {gpus}; or trainer.device=cpu",
        )


def validate(cfg: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` on the first bad value of a resolved config (a plain dict)."""
    t = cfg["trainer"]
    _check(_is_int(t["nproc"]) and t["nproc"] >= 1, "trainer.nproc", t["nproc"], "an integer >= 1")
    _check(_is_int(t["epochs"]) and t["epochs"] >= 1, "trainer.epochs", t["epochs"], "an integer >= 1")
    for key in ("max_steps", "max_epochs_per_run"):
        v = t[key]
        _check(v is None or (_is_int(v) and v >= 1), f"trainer.{key}", v, "null or an integer >= 1")
    _check(_is_int(t["threads"]) and t["threads"] >= 1, "trainer.threads", t["threads"], "an integer >= 1")
    _check(t["device"] in DEVICES, "trainer.device", t["device"], f"one of {', '.join(DEVICES)}")
    if t["device"] in ("auto", "cuda"):
        _check_gpus(t)
    _check(isinstance(t["cudnn_benchmark"], bool), "trainer.cudnn_benchmark", t["cudnn_benchmark"], "true or false")
    for key in ("eval_every", "log_every"):
        _check(_is_int(t[key]) and t[key] >= 1, f"trainer.{key}", t[key], "an integer >= 1")
    es = t["eval_every_steps"]
    _check(es is None or (_is_int(es) and es >= 1), "trainer.eval_every_steps", es, "null or an integer >= 1")
    target = t["target_top1"]
    top1_ok = target is None or (_is_num(target) and 0 < target <= 100)
    _check(top1_ok, "trainer.target_top1", target, "null or a top-1 % in (0, 100]")
    ce = t["checkpoint_every"]
    _check(_is_int(ce) and ce >= 0, "trainer.checkpoint_every", ce, "an integer >= 0 (0: final only)")
    ces = t["checkpoint_every_steps"]
    _check(ces is None or (_is_int(ces) and ces >= 1), "trainer.checkpoint_every_steps", ces, "null or an integer >= 1")
    _check(_is_num(t["timeout_s"]) and t["timeout_s"] > 0, "trainer.timeout_s", t["timeout_s"], "seconds > 0")
    _check(t["on_failure"] in ("abort", "continue"), "trainer.on_failure", t["on_failure"], "abort or continue")
    hang = t["hang_timeout_s"]
    _check(
        _is_num(hang) and 0 < hang < t["timeout_s"],
        "trainer.hang_timeout_s",
        hang,
        f"seconds > 0 and below trainer.timeout_s ({t['timeout_s']})",
    )
    store = t.get("store")
    if store is not None:
        try:
            parse_store(store if isinstance(store, str) else "")
            members_ok = True
        except ValueError:
            members_ok = False
        _check(
            members_ok,
            "trainer.store",
            store,
            "null (torch's store) or 'etcd://host:port,host:port,...' (quoted: Hydra reads commas as a list; "
            "etcds://... with trainer.store_tls)",
        )
    tls = t.get("store_tls") or {}
    try:
        given = Tls.from_config(tls.get("ca"), tls.get("cert"), tls.get("key"))
    except TlsFileError as error:
        raise ConfigError(error.key, error.value, error.problem) from None
    secure = isinstance(store, str) and store.startswith(TLS_SCHEME)
    joiner = store is None and t.get("join")  # (a joiner reads the run's store from the run dir)
    _check(
        bool(given) == secure or bool(joiner),
        "trainer.store_tls",
        None if given is None else dict(tls),
        f"the CA, certificate and key files exactly where trainer.store is {TLS_SCHEME}... (trainer.store={store!r})",
    )
    secret_file = t.get("secret_file")
    if secret_file is not None:
        from distributed.secret import SecretError, read_secret

        try:
            problem = "" if isinstance(secret_file, str) and read_secret(secret_file) else "not a path"
        except (OSError, SecretError) as error:
            problem = str(error)
        _check(not problem, "trainer.secret_file", secret_file, f"null or a file of the run's secret ({problem})")
    ln = t["local_nodes"]
    per_node = "an integer >= 1 that divides trainer.nproc (its processes split evenly into emulated nodes)"
    _check(_is_int(ln) and ln >= 1 and t["nproc"] % ln == 0, "trainer.local_nodes", ln, per_node)
    mr = t["max_restarts"]
    _check(_is_int(mr) and mr >= 0, "trainer.max_restarts", mr, "an integer >= 0")
    join = t["join"]
    _check(isinstance(join, bool), "trainer.join", join, "true or false")
    if join:
        why = "true only with trainer.on_failure=continue (the run it joins must survive changes of its world)"
        _check(t["on_failure"] == "continue", "trainer.join", join, why)
        run_dir = t["run_dir"]
        joinable = isinstance(run_dir, str) and os.path.isfile(os.path.join(run_dir, "join.json"))
        _check(
            joinable,
            "trainer.run_dir",
            run_dir,
            "the run dir of a run training with trainer.on_failure=continue "
            "(it holds join.json while it trains): trainer.join=true joins that run",
        )
    resume = t["resume"]
    if resume not in (None, "auto"):
        _check(
            isinstance(resume, str) and os.path.isfile(resume),
            "trainer.resume",
            resume,
            "null, auto, or the path of an existing checkpoint file",
        )

    dev = t.get("netdev")
    if dev is not None:
        devices = sorted(os.listdir(NETDEV_DIR)) if os.path.isdir(NETDEV_DIR) else []
        _check(
            isinstance(dev, str) and dev in devices,
            "trainer.netdev",
            dev,
            f"null or a network interface of this machine ({', '.join(devices) or 'none found'})",
        )

    _validate_optimizer(cfg["optimizer"])
    _validate_schedule(cfg["schedule"])
    _validate_model(cfg["model"])
    _validate_loader(cfg["data"])
    world_size = world_size_of(cfg)
    validate_scope(cfg["sync"])
    for group in TARGET_GROUPS:
        validator = _validator(group, cfg[group].get("_target_"))
        if validator is not None:
            validator(cfg[group], cfg, world_size)


def _validator(group: str, target: Any) -> Callable[[dict, dict, int], None] | None:
    """The ``validate(section, cfg, world_size)`` of what ``target`` names: the class's own, or for a builder
    function the one beside it in its module."""
    _check(isinstance(target, str), f"{group}._target_", target, "a class or function path")
    try:
        obj = get_object(target)
    except Exception as exc:  # noqa: BLE001 - report any import failure as a config error
        raise ConfigError(f"{group}._target_", target, f"an importable class or function ({exc})") from exc
    if inspect.isclass(obj):
        return getattr(obj, "validate", None)
    return getattr(importlib.import_module(obj.__module__), "validate", None)


def _validate_loader(d: dict[str, Any]) -> None:
    bs, nw = d.get("batch_size"), d.get("num_workers")
    _check(_is_int(bs) and bs >= 1, "data.batch_size", bs, "an integer >= 1 (samples per process)")
    workers = "an integer >= 0, or auto (this process's share of the CPUs, less one)"
    _check(nw == "auto" or (_is_int(nw) and nw >= 0), "data.num_workers", nw, workers)


def _validate_optimizer(o: dict[str, Any]) -> None:
    _check(o["name"] in OPTIMIZERS, "optimizer.name", o["name"], f"one of {', '.join(OPTIMIZERS)}")
    _check(_is_num(o["lr"]) and o["lr"] > 0, "optimizer.lr", o["lr"], "a learning rate > 0")
    wd = o["weight_decay"]
    _check(_is_num(wd) and wd >= 0, "optimizer.weight_decay", wd, "a number >= 0")
    m = o["momentum"]
    _check(_is_num(m) and 0 <= m < 1, "optimizer.momentum", m, "a number in [0, 1)")
    if o["name"] == "momentum":
        _check(m > 0, "optimizer.momentum", m, "a number in (0, 1) for optimizer=momentum (or use optimizer=sgd)")
    tc = o["trust_coeff"]
    _check(_is_num(tc) and tc > 0, "optimizer.trust_coeff", tc, "a number > 0")


def _validate_schedule(s: dict[str, Any]) -> None:
    _check(s["name"] in SCHEDULES, "schedule.name", s["name"], f"one of {', '.join(SCHEDULES)}")
    w = s["warmup_epochs"]
    _check(_is_num(w) and w >= 0, "schedule.warmup_epochs", w, "a number of epochs >= 0")
    f = s["warmup_start_factor"]
    _check(_is_num(f) and 0 <= f <= 1, "schedule.warmup_start_factor", f, "a number in [0, 1]")
    f = s["min_lr_factor"]
    _check(_is_num(f) and 0 <= f <= 1, "schedule.min_lr_factor", f, "a number in [0, 1]")
    _check(_is_num(s["power"]) and s["power"] > 0, "schedule.power", s["power"], "a number > 0")
    g = s["gamma"]
    _check(_is_num(g) and 0 < g <= 1, "schedule.gamma", g, "a number in (0, 1]")
    ms = s["milestones"]
    _check(
        isinstance(ms, list) and all(_is_int(m) and m > 0 for m in ms) and ms == sorted(ms),
        "schedule.milestones",
        ms,
        "an increasing list of epochs > 0",
    )
    b = s["base_batch_size"]
    _check(_is_int(b) and b >= 1, "schedule.base_batch_size", b, "an integer >= 1")


def _validate_model(m: dict[str, Any]) -> None:
    import timm

    name = m["name"]
    _check(
        isinstance(name, str) and timm.is_model(name),
        "model.name",
        name,
        "a timm model name (see timm.list_models(), e.g. resnet50, resnet18, test_resnet, test_vit)",
    )
    d = m["drop_rate"]
    _check(_is_num(d) and 0 <= d < 1, "model.drop_rate", d, "a number in [0, 1)")
    cl = m.get("channels_last", False)
    _check(cl in ("auto", True, False), "model.channels_last", cl, "one of auto, true, false")
    from models.factory import COMPILE_MODES

    c = m.get("compile", False)
    _check(c in (True, False, *COMPILE_MODES), "model.compile", c, f"one of false, true, {', '.join(COMPILE_MODES)}")
    if c is not False:
        import torch

        b = m.get("compile_backend", "inductor")
        backends = torch._dynamo.list_backends(exclude_tags=())
        _check(b in backends, "model.compile_backend", b, f"one of torch.compile's backends ({', '.join(backends)})")
