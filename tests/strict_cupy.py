"""A strict stand-in for CuPy, so the device="cuda" code path runs (and is checked) without a GPU.

`install(monkeypatch)` puts `cupy` (a module object built here) in sys.modules. Its arrays
are `ndarray`, a wrapper around a host NumPy array that computes as NumPy does (float16 stays
float16) but refuses what real CuPy refuses, so a CuPy bug in npqwen fails here too:

- no implicit conversion to NumPy: np.asarray(x), np.array(x), x.__array__() raise TypeError;
- no NumPy arrays as operands of operators, ufuncs (also through NumPy's __array_ufunc__ /
  __array_function__ protocols) or cupy functions: TypeError. Python and NumPy scalars are fine;
- results are never NumPy scalars: a reduction gives a 0-d array; float(x), int(x), bool(x),
  x.item() and x.tolist() work, and copy to the host;
- only names of the real cupy namespace and ndarray, each with the keyword arguments real
  cupy 14 takes (KEYWORDS, METHOD_KEYWORDS): anything else is AttributeError / TypeError.
  That is a subset of cupy (what npqwen uses, and a few neighbours): a name cupy has but the
  stand-in lacks is refused too; add it to the tables (a test checks them against real cupy).

Crossings are counted in `transfers`: host->device by cupy.asarray / cupy.array (and a NumPy
array or list used as an index, which CuPy uploads silently), device->host by x.get(),
cupy.asnumpy and the scalar conversions above. Stricter than CuPy in one place: assigning a
NumPy array into a device array is refused (CuPy raises for a basic index and uploads silently
for an integer-array index). Every name and keyword used is recorded in `used`, so a test can
check them against the real cupy package.
"""
import functools
import sys
import types
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

UFUNC = ("out", "casting", "dtype")   # cupy ufuncs: f(x1, x2, /, out=None, *, casting='same_kind', dtype=None)
UFUNCS = ("add", "subtract", "multiply", "divide", "true_divide", "negative", "exp", "log", "sqrt", "tanh",
          "cos", "sin", "maximum", "minimum", "isfinite", "isnan", "power", "left_shift", "right_shift", "floor_divide",
          "greater", "less", "greater_equal", "less_equal", "equal", "not_equal", "logical_and",
          "logical_not", "log1p", "abs", "absolute", "sign")
# every other cupy function offered: name -> the keyword arguments cupy 14.2 accepts
KEYWORDS = {
    "asarray": ("a", "dtype", "order", "copy", "blocking"),
    "array": ("obj", "dtype", "copy", "order", "subok", "ndmin", "blocking"),
    "asnumpy": ("a", "stream", "order", "out", "blocking"),
    "ascontiguousarray": ("a", "dtype"),
    "empty": ("shape", "dtype", "order"),
    "zeros": ("shape", "dtype", "order"),
    "ones": ("shape", "dtype", "order"),
    "full": ("shape", "fill_value", "dtype", "order"),
    "arange": ("start", "stop", "step", "dtype"),
    "concatenate": ("tup", "axis", "out", "dtype", "casting"),
    "stack": ("tup", "axis", "out", "dtype", "casting"),
    "tile": ("A", "reps"),
    "where": ("condition", "x", "y"),
    "triu": ("m", "k"),
    "tril": ("m", "k"),
    "repeat": ("a", "repeats", "axis"),
    "einsum": ("dtype", "optimize"),
    "matmul": UFUNC,
    "dot": ("a", "b", "out"),
    "sum": ("a", "axis", "dtype", "out", "keepdims"),
    "mean": ("a", "axis", "dtype", "out", "keepdims"),
    "max": ("a", "axis", "out", "keepdims"),
    "min": ("a", "axis", "out", "keepdims"),
    "argmax": ("a", "axis", "dtype", "out", "keepdims"),
    "all": ("a", "axis", "out", "keepdims"),
    "any": ("a", "axis", "out", "keepdims"),
    "cumsum": ("a", "axis", "dtype", "out"),
    "reshape": ("a", "newshape", "order", "copy"),
    "transpose": ("a", "axes"),
    "broadcast_to": ("array", "shape"),
    "argsort": ("a", "axis", "kind"),
    "take_along_axis": ("a", "indices", "axis"),
    "bincount": ("x", "weights", "minlength"),
    "empty_like": ("prototype", "dtype", "order", "subok", "shape"),
    "zeros_like": ("a", "dtype", "order", "subok", "shape"),
    "copyto": ("dst", "src", "casting", "where"),       # compact weights (npqwen/weights.py): a block widened
    "take": ("a", "indices", "axis", "out"),
    "flatnonzero": ("a",),                              # the loss's counted rows (npqwen/grad.py)
    "nonzero": ("a",),                                  # an expert's (token, choice) pairs (moe.experts_backward)
    "put_along_axis": ("arr", "indices", "values", "axis"),   # the router's backward (npqwen/moe.py)
    **{name: UFUNC for name in UFUNCS},
}
METHOD_KEYWORDS = {
    "astype": ("dtype", "order", "casting", "subok", "copy"),
    "view": ("dtype", "type"),
    "reshape": ("order", "copy"),
    "transpose": (),
    "ravel": ("order",),
    "copy": ("order",),
    "fill": ("value",),
    "sum": ("axis", "dtype", "out", "keepdims"),
    "mean": ("axis", "dtype", "out", "keepdims"),
    "max": ("axis", "out", "keepdims"),
    "min": ("axis", "out", "keepdims"),
    "argmax": ("axis", "out", "dtype", "keepdims"),
    "all": ("axis", "out", "keepdims"),
    "any": ("axis", "out", "keepdims"),
    "cumsum": ("axis", "dtype", "out"),
    "get": ("stream", "order", "out", "blocking"),
    "item": (),
    "tolist": (),
}
UFUNC_METHOD_KEYWORDS = {"add.at": ("a", "indices", "b")}   # ufunc methods offered: cupy.add.at
ATTRIBUTES = ("shape", "dtype", "ndim", "size", "nbytes", "itemsize", "strides", "T")
DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
          "uint64", "bool_", "dtype")
MEMORY = (40 << 30, 80 << 30)        # what cuda.runtime.memGetInfo reports: (free, total) bytes


@dataclass
class Transfers:
    """Host<->device copies since the last reset: counts and bytes each way."""
    to_device: int = 0
    to_device_bytes: int = 0
    to_host: int = 0
    to_host_bytes: int = 0

    def reset(self):
        self.__init__()

    def upload(self, a: np.ndarray):
        self.to_device += 1
        self.to_device_bytes += a.nbytes

    def download(self, a: np.ndarray):
        self.to_host += 1
        self.to_host_bytes += a.nbytes


transfers = Transfers()
used = defaultdict(set)               # "cupy.NAME" or "ndarray.NAME" -> keyword arguments passed


def record(name: str, keywords=(), allowed=None):
    """Note a name (and keywords) used; refuse a keyword that real CuPy does not take, as CuPy would."""
    used[name].update(keywords)
    bad = [k for k in keywords if allowed is not None and k not in allowed]
    if bad:
        raise TypeError(f"{name}() got an unexpected keyword argument {bad[0]!r} (real CuPy takes only "
                        f"{', '.join(allowed) or 'none'})")


def checked(name: str, allowed: tuple):
    """Decorate a function written out here (its signature CuPy's) so its keywords are recorded and checked."""
    def decorate(function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            record(name, kwargs, allowed)
            return function(*args, **kwargs)
        return call
    return decorate


def refuse_numpy(value, where: str):
    """CuPy refuses NumPy arrays where it expects device arrays, naming the type."""
    if isinstance(value, np.ndarray):
        raise TypeError(f"Unsupported type <class 'numpy.ndarray'> in {where}: a NumPy array mixed into a "
                        f"device operation (CuPy refuses it; move it with cupy.asarray first)")


def host(value, where: str):
    """The NumPy array inside a device operand (recursing into lists and tuples); scalars pass."""
    if isinstance(value, ndarray):
        return value._a
    refuse_numpy(value, where)
    if isinstance(value, (list, tuple)):
        return type(value)(host(v, where) for v in value)
    return value


def device(result):
    """Wrap NumPy results as device arrays; a NumPy scalar becomes a 0-d array, as in CuPy."""
    if isinstance(result, np.ndarray):
        return ndarray._wrap(result)
    if isinstance(result, np.generic):
        return ndarray._wrap(np.asarray(result))
    if isinstance(result, tuple):
        return tuple(device(r) for r in result)
    return result


def compute(name: str, args, kwargs):
    """Run the NumPy function behind cupy.NAME on unwrapped operands; `out` keeps its wrapper."""
    where = f"cupy.{name}"
    if name in UFUNCS and any(isinstance(a, (list, tuple)) for a in args):
        raise TypeError(f"Unsupported type <class 'list'> in {where} (CuPy ufuncs take arrays and scalars)")
    result = getattr(np, name)(*host(args, where), **{k: host(v, where) for k, v in kwargs.items()})
    out = kwargs.get("out")
    return out if isinstance(out, ndarray) and result is out._a else device(result)


def upload(value, dtype=None) -> "ndarray":
    """Host -> device: a device copy of `value` (NumPy array, list or scalar), counted."""
    a = np.array(value, dtype=dtype, copy=True)
    transfers.upload(a)
    return ndarray._wrap(a)


def download(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Device -> host: a host copy (into `out` if given), counted."""
    transfers.download(a)
    if out is None:
        return a.copy()
    out[...] = a
    return out


def device_index(index):
    """An index for a device array: device arrays unwrapped; NumPy arrays and lists are uploaded (and
    counted) as CuPy uploads them."""
    if isinstance(index, tuple):
        return tuple(device_index(i) for i in index)
    if isinstance(index, ndarray):
        return index._a
    if isinstance(index, (np.ndarray, list)):
        return upload(index)._a
    return index


class ndarray:
    """A device array: a NumPy array that can be reached only through CuPy's own ways across."""
    __slots__ = ("_a",)
    __hash__ = None

    def __init__(self, shape, dtype=float):    # cupy.ndarray(shape, dtype): uninitialised memory
        self._a = np.empty(shape, dtype=dtype)

    @classmethod
    def _wrap(cls, a: np.ndarray) -> "ndarray":
        x = object.__new__(cls)
        x._a = a
        return x

    def __getattribute__(self, name):
        if not name.startswith("_"):
            if name not in METHOD_KEYWORDS and name not in ATTRIBUTES:
                used[f"ndarray.{name}"]   # noqa: B018  recorded as asked for, then refused
                raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r} (strict CuPy stand-in: "
                                     f"real cupy.ndarray lacks it, or tests/strict_cupy.py does not offer it yet)")
            used[f"ndarray.{name}"]   # noqa: B018
        return object.__getattribute__(self, name)

    # What NumPy hands over: refused when it means a silent copy to the host, as in CuPy.
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
                        "construct a NumPy array explicitly.")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """np.add(x, y), or `numpy_array + x`: run as the cupy ufunc, which refuses NumPy operands."""
        if method != "__call__" or ufunc.__name__ not in KEYWORDS:
            return NotImplemented
        return compute(ufunc.__name__, inputs, kwargs)

    def __array_function__(self, func, kinds, args, kwargs):
        """np.concatenate([x, y]) and the like: run as cupy's function of that name, if it has one."""
        if func.__name__ not in KEYWORDS:
            return NotImplemented
        return compute(func.__name__, args, kwargs)

    # Attributes.
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    T = property(lambda self: ndarray._wrap(self._a.T))

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (ndarray._wrap(row) for row in self._a)

    def __repr__(self):
        return f"strict_cupy.ndarray({self._a!r})"

    # Indexing.
    def __getitem__(self, index):
        return device(self._a[device_index(index)])

    def __setitem__(self, index, value):
        refuse_numpy(value, "ndarray.__setitem__")
        self._a[device_index(index)] = host(value, "ndarray.__setitem__")

    # Methods (astype, reshape, sum, ...: set below): NumPy's, with CuPy's keywords.
    def _method(self, name, args, kwargs):
        record(f"ndarray.{name}", kwargs, METHOD_KEYWORDS[name])
        result = getattr(self._a, name)(*host(args, f"ndarray.{name}"),
                                        **{k: host(v, f"ndarray.{name}") for k, v in kwargs.items()})
        out = kwargs.get("out")
        return out if isinstance(out, ndarray) and result is out._a else device(result)

    # The ways to the host, each counted.
    @checked("ndarray.get", METHOD_KEYWORDS["get"])
    def get(self, stream=None, order="C", out=None, blocking=True):
        return download(self._a, out)

    def item(self):
        return download(self._a).item()

    def tolist(self):
        return download(self._a).tolist()

    def __float__(self):
        return float(download(self._a))

    def __int__(self):
        return int(download(self._a))

    def __index__(self):
        return download(self._a).__index__()

    def __bool__(self):
        return bool(download(self._a))


def _operator(ufunc: str, reflected: bool = False, inplace: bool = False):
    """An arithmetic operator as cupy's ufunc of that name (no record: operators are not names)."""
    def op(self, other):
        refuse_numpy(other, f"the {ufunc} operator")
        if isinstance(other, (list, tuple)):
            return NotImplemented
        args = (other, self) if reflected else (self, other)
        return compute(ufunc, args, {"out": self} if inplace else {})
    return op


def _numpy_method(name: str):
    """x.NAME(...) as NumPy computes it, with only the keywords cupy.ndarray.NAME takes."""
    def method(self, *args, **kwargs):
        return self._method(name, args, kwargs)
    method.__name__ = name
    return method


for _name in ("astype", "view", "reshape", "transpose", "ravel", "copy", "fill", "sum", "mean", "max", "min",
              "argmax", "all", "any", "cumsum"):
    setattr(ndarray, _name, _numpy_method(_name))
for _name, _ufunc in (("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("truediv", "true_divide"),
                      ("pow", "power"), ("lshift", "left_shift"), ("rshift", "right_shift"),
                      ("floordiv", "floor_divide"),
                      ("matmul", "matmul")):
    setattr(ndarray, f"__{_name}__", _operator(_ufunc))
    setattr(ndarray, f"__r{_name}__", _operator(_ufunc, reflected=True))
    setattr(ndarray, f"__i{_name}__", _operator(_ufunc, inplace=True))
for _name, _ufunc in (("lt", "less"), ("le", "less_equal"), ("gt", "greater"), ("ge", "greater_equal"),
                      ("eq", "equal"), ("ne", "not_equal")):
    setattr(ndarray, f"__{_name}__", _operator(_ufunc))
ndarray.__neg__ = lambda self: compute("negative", (self,), {})
ndarray.__abs__ = lambda self: compute("absolute", (self,), {})
ndarray.__invert__ = lambda self: compute("logical_not", (self,), {})


class StrictModule(types.ModuleType):
    """The `cupy` module: records every public name asked for; a name it does not offer is an AttributeError."""

    def __getattr__(self, name):   # only for names not set on the module
        if not name.startswith("_"):   # private names (__path__, _core) are the import system's probes
            used[f"cupy.{name}"]   # noqa: B018
        raise AttributeError(f"module 'cupy' has no attribute {name!r} (strict CuPy stand-in: real cupy lacks "
                             f"it, or tests/strict_cupy.py does not offer it yet)")

    def __getattribute__(self, name):
        if not name.startswith("_"):
            used[f"cupy.{name}"]   # noqa: B018
        return super().__getattribute__(name)


def _function(name: str):
    """cupy.NAME: checks its keywords, then computes as NumPy does on the device arrays."""
    def function(*args, **kwargs):
        record(f"cupy.{name}", kwargs, KEYWORDS[name])
        return compute(name, args, kwargs)
    function.__name__ = function.__qualname__ = name
    return function


@checked("cupy.add.at", UFUNC_METHOD_KEYWORDS["add.at"])
def add_at(a, indices, b=None):
    """cupy.add.at(a, indices, b): a[indices] += b, a repeated index adding each time (the backwards' scatter)."""
    if not isinstance(a, ndarray):
        raise TypeError(f"cupy.add.at writes into a cupy.ndarray, got {type(a)}")
    np.add.at(a._a, host(indices, "cupy.add.at"), host(b, "cupy.add.at"))


@checked("cupy.asarray", KEYWORDS["asarray"])
def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    """Host -> device (counted) for NumPy arrays, lists and scalars; a device array stays (cast if asked)."""
    if isinstance(a, ndarray):
        return a if dtype is None else ndarray._wrap(a._a.astype(dtype, copy=False))
    return upload(a, dtype)


@checked("cupy.array", KEYWORDS["array"])
def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        return ndarray._wrap(np.array(obj._a, dtype=dtype, copy=True))
    return upload(obj, dtype)


@checked("cupy.asnumpy", KEYWORDS["asnumpy"])
def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """Device -> host (counted); a NumPy array is returned as it is, as CuPy does."""
    return download(a._a, out) if isinstance(a, ndarray) else np.asarray(a)


class CUDARuntimeError(RuntimeError):
    """cupy.cuda.runtime.CUDARuntimeError."""


def _runtime_function(name, value):
    def function():
        used[f"cupy.cuda.runtime.{name}"]   # noqa: B018
        return value
    function.__name__ = name
    return function


def make_module() -> StrictModule:
    """A fresh `cupy` module object: the functions above, the dtypes, and cuda.runtime (one GPU)."""
    cupy = StrictModule("cupy", "A strict stand-in for CuPy (tests/strict_cupy.py).")
    for name in KEYWORDS:
        setattr(cupy, name, _function(name))
    cupy.asarray, cupy.array, cupy.asnumpy, cupy.ndarray = asarray, array, asnumpy, ndarray
    cupy.add.at = add_at
    for name in DTYPES:
        setattr(cupy, name, getattr(np, name))
    runtime = types.SimpleNamespace(getDeviceCount=_runtime_function("getDeviceCount", 1),
                                    memGetInfo=_runtime_function("memGetInfo", MEMORY),
                                    CUDARuntimeError=CUDARuntimeError)
    cupy.cuda = types.SimpleNamespace(runtime=runtime)
    return cupy


cupy = make_module()


def install(monkeypatch) -> StrictModule:
    """Make `import cupy` give the stand-in for this test (pytest's monkeypatch undoes it); counters reset."""
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    transfers.reset()
    return cupy


def offered_names() -> dict[str, tuple]:
    """Every name the stand-in offers, with the keywords it accepts: "cupy.X" / "ndarray.X" -> keywords."""
    names = {f"cupy.{n}": k for n, k in KEYWORDS.items()}
    names.update({f"cupy.{n}": () for n in (*DTYPES, "ndarray", "cuda")})
    names.update({"cupy.asarray": KEYWORDS["asarray"], "cupy.array": KEYWORDS["array"],
                  "cupy.asnumpy": KEYWORDS["asnumpy"]})
    names.update({f"cupy.cuda.runtime.{n}": () for n in ("getDeviceCount", "memGetInfo", "CUDARuntimeError")})
    names.update({f"cupy.{n}": k for n, k in UFUNC_METHOD_KEYWORDS.items()})
    names.update({f"ndarray.{n}": k for n, k in METHOD_KEYWORDS.items()})
    names.update({f"ndarray.{n}": () for n in ATTRIBUTES})
    return names
