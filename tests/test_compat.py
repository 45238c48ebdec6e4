"""Coming from fairscale: the public signatures of the components against fairscale 0.4.13's, read from its source
archive by tools/fairscale_signatures.py (CI does not install fairscale), and `ddpkit.compat.fairscale`'s opt-in
import aliases, with and without a real fairscale package present."""

import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ddpkit.compat.fairscale as compat
from ddpkit.nn import ShardedDataParallel, SlowMoBaseAlgorithm, SlowMoDistributedDataParallel
from ddpkit.optim import OSS, AdaScale, AdaScaleWrapper, ShardedGradScaler

# fairscale 0.4.13's signatures, read from its source archive by tools/fairscale_signatures.py (see there)
FAIRSCALE = json.loads((Path(__file__).parent / "data" / "fairscale_signatures.json").read_text())
CLASSES = {c.__name__: c for c in (OSS, ShardedDataParallel, AdaScale, AdaScaleWrapper, ShardedGradScaler)}
CLASSES["SlowMoDistributedDataParallel"] = SlowMoDistributedDataParallel
# defaults that read differently but are the same value: fairscale's `dist.group.WORLD` is evaluated when its module
# is imported, before any process group exists, and is None then
SAME_DEFAULT = {"dist.group.WORLD": "None"}


def _parse(recorded):
    """[(kind, name, default text)] from the recorded text; kind '', '*' or '**'."""
    out = []
    for item in filter(None, (s.strip() for s in recorded.split(", "))):
        if item.startswith("*"):
            stars = "**" if item.startswith("**") else "*"
            out.append((stars, item.lstrip("*"), None))
        else:
            name, _, default = item.partition("=")
            out.append(("", name, SAME_DEFAULT.get(default, default) or None))
    return out


def _default_text(value):
    if inspect.isclass(value):
        return value.__qualname__  # fairscale's source names the class as imported (SGD)
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
    assert FAIRSCALE["source"] == "fairscale-0.4.13" and set(FAIRSCALE["signatures"]) == set(CLASSES)
    problems = []
    for cls_name, methods in FAIRSCALE["signatures"].items():
        assert len(methods) >= 1, cls_name
        for name, recorded in methods.items():
            cls = CLASSES[cls_name]
            problems += [f"{cls_name}.{name}: {p}" for p in _compatible(getattr(cls, name), recorded)]
    assert not problems, "\n".join(problems)
    # the check itself can fail: a renamed parameter, a changed default, a missing **kwargs
    assert _compatible(OSS.consolidate_state_dict, "rank=0") and _compatible(OSS.state_dict, "all_ranks=True")
    assert _compatible(OSS.refresh_trainable, "**kwargs")


@pytest.mark.skipif(not os.environ.get("FAIRSCALE_SDIST"), reason="set FAIRSCALE_SDIST to fairscale-0.4.13.tar.gz")
def test_the_recorded_signatures_are_the_archives():
    """With the archive at hand (pip download fairscale==0.4.13 --no-deps), the file is exactly what the tool reads."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tools"))
    import fairscale_signatures

    assert fairscale_signatures.read(os.environ["FAIRSCALE_SDIST"]) == FAIRSCALE


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
            _import("from fairscale.nn import Pipe")
        assert "fairscale.nn.Pipe is not provided by ddpkit" in str(refused.value)
        # names clients import eagerly (transformers' Trainer) import, and refuse when used, naming the way
        stub = _import("from fairscale.nn.data_parallel import FullyShardedDataParallel")
        assert _import("from fairscale.nn.wrap import auto_wrap").__name__ == "auto_wrap"
        with pytest.raises(NotImplementedError) as refused:
            stub(torch.nn.Linear(2, 2))
        assert isinstance(refused.value, compat.NotProvided)
        with pytest.raises(ImportError) as refused:
            _import("from fairscale.nn import FullyShardedDataParallel")(torch.nn.Linear(2, 2))
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


def test_the_aliases_answer_the_import_system_and_metadata_only_while_installed():
    """What clients probe before importing fairscale: ``importlib.util.find_spec`` (which needs a module's
    ``__spec__``), ``importlib.metadata.version`` (a requirement check), ``__file__``; none of it after uninstall."""
    import importlib.metadata
    import importlib.util

    with compat.installed():
        spec = importlib.util.find_spec("fairscale")
        assert spec is not None and spec.submodule_search_locations == []
        assert importlib.util.find_spec("fairscale.optim.oss").name == "fairscale.optim.oss"
        assert importlib.metadata.version("fairscale") == "0.4.13"
        import fairscale

        assert fairscale.__file__ == compat.__file__
    assert importlib.util.find_spec("fairscale") is None
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("fairscale")
