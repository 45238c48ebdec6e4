"""Coming from fairscale: the public signatures of the components against fairscale 0.4.13's (recorded here, not
imported: CI does not install fairscale), and `ddpkit.compat.fairscale`'s opt-in import aliases, with and
without a real fairscale package present."""

import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

import ddpkit.compat.fairscale as compat
from ddpkit.nn import ShardedDataParallel, SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from ddpkit.optim import OSS, AdaScale, AdaScaleWrapper, ShardedGradScaler

# fairscale 0.4.13's signatures (without self), as inspect.signature shows them; a class default as module.name.
FAIRSCALE_SIGNATURES = {
    OSS: {
        "__init__": "params, optim=torch.optim.sgd.SGD, group=None, broadcast_buffer_size=-1, broadcast_fp16=False, "
        "force_broadcast_object=False, **default",
        "step": "closure=None, **kwargs",
        "clip_grad_norm": "max_norm, norm_type=2.0, filter_params_fn=None",
        "consolidate_state_dict": "recipient_rank=0",
        "state_dict": "all_ranks=False",
        "load_state_dict": "state_dict",
        "refresh_trainable": "",
        "add_param_group": "param_group",
        "partition_parameters": "",
    },
    ShardedDataParallel: {
        "__init__": "module, sharded_optimizer, process_group=None, broadcast_buffers=True, "
        "sync_models_at_startup=True, reduce_buffer_size=8388608, auto_refresh_trainable=True, reduce_fp16=False, "
        "warn_on_trainable_params_changed=True",
        "forward": "*inputs, **kwargs",
        "reduce": "",
        "sync_buffers": "blocking=False",
        "zero_grad": "set_to_none=False",
        "no_sync": "",
        "refresh_trainable": "",
        "to": "device, dtype=None, non_blocking=False",
    },
    AdaScale: {
        "__init__": "optimizer, world_size=None, scale=None, smoothing=None, num_gradients_to_accumulate=1, "
        "is_scaled_loss=True, debias_ewma=True",
        "gain": "pg_idx=None",
        "set_scale": "scale, update_estimate=True",
        "set_num_gradients_to_accumulate": "num_gradients_to_accumulate, update_smoothing=True",
        "scale_grad_by_num_grads_to_accum": "",
        "unhook": "",
        "zero_grad": "",
        "add_param_group": "pg",
        "state_dict": "",
        "load_state_dict": "data",
        "step": "*args, **kwargs",
    },
    AdaScaleWrapper: {
        "__init__": "params, world_size=None, scale=None, smoothing=None, num_gradients_to_accumulate=1, "
        "debias_ewma=True, optim_cls=torch.optim.sgd.SGD, **additional_optim_args",
    },
    SlowMoDistributedDataParallel: {
        "__init__": "module, nprocs_per_node, broadcast_buffers=True, "
        "slowmo_base_algorithm=SlowMoBaseAlgorithm.LOCALSGD, slowmo_momentum=0.5, slowmo_memory_efficient=True, "
        "slowmo_frequency=48, slowmo_lr=1.0, slowmo_num_shards=32, localsgd_frequency=3, graph=None, mixing=None, "
        "push_sum=True, overlap=False, synch_freq=0, use_streams=True, slowmo_sgp_average_params=False, "
        "verbose=False, profile_mode=False, process_rank=None, process_world_size=None, global_group=None, "
        "master_group=None, local_node_group=None, comm_device=None",
        "perform_slowmo": "optimizer, fp32_params=None",
        "state_dict": "",
        "load_state_dict": "state_dict",
        "train": "mode=True",
        "eval": "",
    },
    ShardedGradScaler: {  # ddpkit adds a keyword-only device after fairscale's parameters
        "__init__": "init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True, "
        "process_group=None",
        "scale": "outputs",
        "step": "optimizer, *args, **kwargs",
        "unscale_": "optimizer",
        "update": "new_scale=None",
    },
}


def _parse(recorded):
    """[(kind, name, default text)] from the recorded text; kind '', '*' or '**'."""
    out = []
    for item in filter(None, (s.strip() for s in recorded.split(", "))):
        if item.startswith("*"):
            stars = "**" if item.startswith("**") else "*"
            out.append((stars, item.lstrip("*"), None))
        else:
            name, _, default = item.partition("=")
            out.append(("", name, default or None))
    return out


def _default_text(value):
    if inspect.isclass(value):
        return f"{value.__module__}.{value.__qualname__}"
    if isinstance(value, SlowMoBaseAlgorithm):
        return f"SlowMoBaseAlgorithm.{value.name}"
    return repr(value)


def _compatible(function, recorded):
    """Problems with calling `function` the ways fairscale's signature allows: fairscale's named parameters in the
    same order with the same defaults; ddpkit may add parameters after them only with defaults (or *args /
    **kwargs); a *args / **kwargs of fairscale must exist (its name does not matter)."""
    params = list(inspect.signature(function).parameters.values())[1:]  # without self
    problems, ours = [], [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    theirs = _parse(recorded)
    named = [t for t in theirs if t[0] == ""]
    for i, (_, name, default) in enumerate(named):
        if i >= len(ours) or ours[i].name != name:
            problems.append(f"parameter {i} is {ours[i].name if i < len(ours) else None!r}, fairscale: {name!r}")
            continue
        ours_default = None if ours[i].default is inspect.Parameter.empty else _default_text(ours[i].default)
        if ours_default != default:
            problems.append(f"{name}: default {ours_default}, fairscale: {default}")
    problems += [f"added parameter {p.name} has no default" for p in ours[len(named) :] if p.default is p.empty]
    for stars, kind in (("*", inspect.Parameter.VAR_POSITIONAL), ("**", inspect.Parameter.VAR_KEYWORD)):
        if any(t[0] == stars for t in theirs) and not any(p.kind == kind for p in params):
            problems.append(f"no {stars}{'args' if stars == '*' else 'kwargs'}")
    return problems


def test_signatures_match_fairscale():
    problems = []
    for cls, methods in FAIRSCALE_SIGNATURES.items():
        for name, recorded in methods.items():
            problems += [f"{cls.__name__}.{name}: {p}" for p in _compatible(getattr(cls, name), recorded)]
    assert not problems, "\n".join(problems)
    # the check itself can fail: a renamed parameter, a changed default, a missing **kwargs
    assert _compatible(OSS.consolidate_state_dict, "rank=0") and _compatible(OSS.state_dict, "all_ranks=True")
    assert _compatible(OSS.refresh_trainable, "**kwargs")


def test_adascale_properties_and_attribute_fallback():
    layer = torch.nn.Linear(2, 1)
    sgd = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    opt = AdaScale(sgd, num_gradients_to_accumulate=4, smoothing=0.5)
    assert (opt.scale, opt.smoothing) == (4.0, 0.5) and opt.param_groups is sgd.param_groups
    assert opt.state is sgd.state and opt.defaults is sgd.defaults
    sgd.custom_attribute, sgd._private_attribute = 3, 4  # fairscale falls back for any name
    assert opt.custom_attribute == 3 and opt._private_attribute == 4
    with pytest.raises(AttributeError):
        _ = opt.no_such_attribute


# -- ddpkit.compat.fairscale ---------------------------------------------------------------------------------------

# the import statements of fairscale users' code, and the ddpkit object each must give
IMPORTS = {
    "from fairscale.optim import OSS": OSS,
    "from fairscale.optim import AdaScale": AdaScale,
    "from fairscale.optim import AdaScaleWrapper": AdaScaleWrapper,
    "from fairscale.optim.oss import OSS": OSS,
    "from fairscale.optim.adascale import AdaScale": AdaScale,
    "from fairscale.optim.grad_scaler import ShardedGradScaler": ShardedGradScaler,
    "from fairscale.nn import ShardedDataParallel": ShardedDataParallel,
    "from fairscale.nn.data_parallel import ShardedDataParallel": ShardedDataParallel,
    "from fairscale.nn.data_parallel.sharded_ddp import ShardedDataParallel": ShardedDataParallel,
    "from fairscale.experimental.nn.data_parallel import SlowMoDistributedDataParallel": SlowMoDistributedDataParallel,
    "from fairscale.experimental.nn.data_parallel import SlowMoBaseAlgorithm": SlowMoBaseAlgorithm,
    "from fairscale.experimental.nn.data_parallel.gossip import SlowMoDistributedDataParallel": (
        SlowMoDistributedDataParallel
    ),
}


def _import(statement):
    namespace = {}
    exec(statement, namespace)
    return namespace[statement.rsplit(" ", 1)[1]]


def test_install_resolves_fairscale_imports_to_ddpkit():
    assert not compat.is_installed()
    with compat.installed():
        assert compat.is_installed()
        for statement, expected in IMPORTS.items():
            assert _import(statement) is expected, statement
        import fairscale.nn  # the alias, not the real package

        assert fairscale.nn.ShardedDataParallel is ShardedDataParallel
        assert fairscale.optim.OSS is OSS and fairscale.__version__ == "0.4.13"
        with pytest.raises(ModuleNotFoundError, match=r"fairscale\.nn\.misc is not provided by ddpkit"):
            _import("from fairscale.nn.misc import FlattenParamsWrapper")
        # a name the alias lacks, imported from a module that exists: what is provided and what to use instead
        with pytest.raises(ImportError) as refused:
            _import("from fairscale.nn import FullyShardedDataParallel")
        message = str(refused.value)
        assert "fairscale.nn.FullyShardedDataParallel is not provided by ddpkit" in message
        assert "torch.distributed.fsdp.fully_shard" in message
        assert "fairscale.nn provides ShardedDataParallel" in message
        assert all(name in message for module in compat.ALIASES.values() for name in module)
        assert not hasattr(fairscale.nn, "__wrapped__")  # probes of private names stay AttributeErrors
        with compat.installed():  # nested: leaving the inner block keeps the outer installation
            pass
        assert compat.is_installed() and _import("from fairscale.optim import OSS") is OSS
    assert not compat.is_installed()
    assert not any(vars(m).get("__ddpkit_alias__") for m in list(sys.modules.values()) if m is not None)
    compat.install()
    compat.install()  # idempotent
    assert _import("from fairscale.optim import OSS") is OSS
    compat.uninstall()
    compat.uninstall()
    assert "fairscale.optim" not in sys.modules or not getattr(sys.modules["fairscale.optim"], "__ddpkit_alias__", 0)


_WITH_A_REAL_FAIRSCALE = """
import sys
import ddpkit, ddpkit.nn, ddpkit.optim, ddpkit.compat.fairscale as compat
assert not compat.is_installed(), "installed by import ddpkit"
import fairscale.optim, fairscale.nn.data_parallel
real_optim = sys.modules["fairscale.optim"]
assert fairscale.optim.OSS == "real OSS" and not hasattr(fairscale.optim, "__ddpkit_alias__")
with compat.installed():
    from fairscale.optim import OSS
    from fairscale.nn.data_parallel import ShardedDataParallel
    assert OSS is ddpkit.optim.OSS and ShardedDataParallel is ddpkit.nn.ShardedDataParallel
    assert "fairscale.nn.data_parallel.only_real" not in sys.modules
    try:
        import fairscale.nn.data_parallel.only_real
        raise AssertionError("the real fairscale was not shadowed")
    except ModuleNotFoundError as exc:
        assert "not provided by ddpkit" in str(exc)
assert sys.modules["fairscale.optim"] is real_optim
from fairscale.optim import OSS
from fairscale.nn.data_parallel import only_real
assert OSS == "real OSS" and only_real.VALUE == 1
print("ok")
"""


def test_opt_in_and_shadows_a_real_fairscale(tmp_path):
    """A stand-in fairscale package on sys.path (CI has none): not touched by ``import ddpkit``; shadowed while
    installed, modules imported before included; restored exactly by uninstall."""
    files = {
        "fairscale/__init__.py": "",
        "fairscale/optim/__init__.py": "OSS = 'real OSS'\n",
        "fairscale/nn/__init__.py": "",
        "fairscale/nn/data_parallel/__init__.py": "ShardedDataParallel = 'real SDP'\n",
        "fairscale/nn/data_parallel/only_real.py": "VALUE = 1\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    env_path = f"{tmp_path}:{':'.join(p for p in sys.path if p)}"
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_WITH_A_REAL_FAIRSCALE)],
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
