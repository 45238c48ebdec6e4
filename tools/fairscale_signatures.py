"""Reads fairscale's public signatures from its source distribution, for tests/test_compat.py.

    pip download fairscale==0.4.13 --no-deps -d /tmp/fs
    python tools/fairscale_signatures.py /tmp/fs/fairscale-0.4.13.tar.gz > tests/data/fairscale_signatures.json

The source is parsed (never imported: fairscale's import needs what CI does not install), and for each class
ddpkit matches, every method its body defines is written as ``name=default, *args, **kwargs`` without ``self``:
a default that is a constant expression as its value's repr (``2 ** 23`` as ``8388608``), any other default as
its source text (``SGD``, ``SlowMoBaseAlgorithm.LOCALSGD``). Methods fairscale inherits (from torch) are left
out. The archive's SHA-256 is recorded beside them.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import tarfile
from typing import Any

# ddpkit's name -> (fairscale's module file inside the archive, fairscale's class name)
CLASSES = {
    "OSS": ("fairscale/optim/oss.py", "OSS"),
    "ShardedDataParallel": ("fairscale/nn/data_parallel/sharded_ddp.py", "ShardedDataParallel"),
    "AdaScale": ("fairscale/optim/adascale.py", "AdaScale"),
    "AdaScaleWrapper": ("fairscale/optim/adascale.py", "AdaScaleWrapper"),
    "SlowMoDistributedDataParallel": (
        "fairscale/experimental/nn/data_parallel/gossip/distributed.py",
        "SlowMoDistributedDataParallel",
    ),
    "ShardedGradScaler": ("fairscale/optim/grad_scaler.py", "ShardedGradScaler"),
}


def default_text(node: ast.expr) -> str:
    """A default's text: the repr of a constant expression's value, else its source."""
    if all(isinstance(n, ast.Constant | ast.BinOp | ast.UnaryOp | ast.operator | ast.unaryop) for n in ast.walk(node)):
        return repr(eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}}))
    return ast.unparse(node)


def signature_text(function: ast.FunctionDef) -> str:
    """``a, b=default, *args, c=default, **kwargs`` without the first parameter (self)."""
    args = function.args
    positional = [*args.posonlyargs, *args.args][1:]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    items = [a.arg if d is None else f"{a.arg}={default_text(d)}" for a, d in zip(positional, defaults, strict=True)]
    if args.vararg is not None:
        items.append(f"*{args.vararg.arg}")
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        items.append(a.arg if d is None else f"{a.arg}={default_text(d)}")
    if args.kwarg is not None:
        items.append(f"**{args.kwarg.arg}")
    return ", ".join(items)


def public_methods(source: str, class_name: str) -> dict[str, str]:
    """The signatures of `class_name`'s public methods and ``__init__``, as its body defines them."""
    tree = ast.parse(source)
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    out = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and (node.name == "__init__" or not node.name.startswith("_")):
            if any(isinstance(d, ast.Name) and d.id in ("property", "staticmethod") for d in node.decorator_list):
                continue
            if any(isinstance(d, ast.Attribute) and d.attr == "setter" for d in node.decorator_list):
                continue
            out[node.name] = signature_text(node)
    return out


def read(archive: str) -> dict[str, Any]:
    with open(archive, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    signatures = {}
    with tarfile.open(archive) as tar:
        root = tar.getnames()[0].split("/")[0]
        for ours, (path, theirs) in CLASSES.items():
            member = tar.extractfile(f"{root}/{path}")
            assert member is not None, path
            signatures[ours] = public_methods(member.read().decode(), theirs)
    return {"source": root, "sha256": digest, "signatures": signatures}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/fairscale_signatures.py fairscale-VERSION.tar.gz")
    print(json.dumps(read(sys.argv[1]), indent=1, sort_keys=True))
