"""No pickle on the wire: scan every project source file for deserialisers that can run code.

A frame, a weights bucket or a Redis value comes from the network; unpickling it would let
whoever can reach the socket run code in the learner. The scan parses each file (AST, so
comments and strings do not count) and flags imports of pickle-family modules, ``torch.load``
without ``weights_only=True``, pyzmq's ``recv_pyobj``/``send_pyobj``/``recv_serialized``, and
``numpy.load(..., allow_pickle=True)``. Explicit, reasoned exceptions live in ``ALLOWED``.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ["streamrl", "workers", "launcher", "tools", "docker"]
PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib", "jsonpickle"}
PYOBJ_CALLS = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}

# path -> findings allowed there, each with the reason it is not network data.
ALLOWED: dict[str, dict[str, str]] = {
    "streamrl/bench/transport.py": {
        "import pickle": "the transport benchmark's pickle-over-ZeroMQ BASELINE (measured against, never used "
                         "by StreamRL); both ends are the benchmark's own processes",
    },
}


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return "?"


def _kw(call: ast.Call, key: str):
    for k in call.keywords:
        if k.arg == key and isinstance(k.value, ast.Constant):
            return k.value.value
    return None


def findings(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PICKLE_MODULES:
            out.append((node.lineno, f"import {node.module}"))
        elif isinstance(node, ast.Call):
            fn = _name(node.func)
            last = fn.rsplit(".", 1)[-1]
            if fn == "torch.load" or fn.endswith(".torch.load"):
                weights_only = _kw(node, "weights_only")
                out.append((node.lineno, "torch.load(weights_only=True)" if weights_only is True else "torch.load"))
            elif last in PYOBJ_CALLS:
                out.append((node.lineno, last))
            elif fn in ("np.load", "numpy.load") and _kw(node, "allow_pickle") is True:
                out.append((node.lineno, "numpy.load(allow_pickle=True)"))
    return out


def scan() -> dict[str, list[tuple[int, str]]]:
    hits = {}
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")) if (REPO / top).is_dir() else []:
            rel = path.relative_to(REPO).as_posix()
            found = findings(ast.parse(path.read_text(), filename=rel))
            if found:
                hits[rel] = found
    return hits


def test_scanner_catches_every_form():
    src = ("import pickle\nfrom cloudpickle import loads\nimport marshal as m\nimport torch\n"
           "torch.load(f)\ntorch.load(f, weights_only=False)\nsock.recv_pyobj()\nnp.load(p, allow_pickle=True)\n"
           "x = '''pickle.loads(data)'''  # pickle.loads in a string or comment is fine\n")
    got = [what for _, what in findings(ast.parse(src))]
    assert got.count("torch.load") == 2
    for expected in ("import pickle", "import cloudpickle", "import marshal", "recv_pyobj", "numpy.load(allow_pickle=True)"):
        assert expected in got, (expected, got)
    assert len(got) == 7


def test_no_unpickling_of_network_data_anywhere():
    hits = scan()
    bad = {path: [(ln, what) for ln, what in found if what not in ALLOWED.get(path, {})]
           for path, found in hits.items()}
    bad = {p: f for p, f in bad.items() if f}
    assert not bad, f"pickle-family deserialisation outside the allow-list (network data must be JSON/raw): {bad}"
    # the allow-list stays honest: every entry is still needed
    for path, allowed in ALLOWED.items():
        seen = {what for _, what in hits.get(path, [])}
        assert set(allowed) <= seen, f"stale ALLOWED entry for {path}: {set(allowed) - seen}"
