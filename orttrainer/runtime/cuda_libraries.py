"""The libraries ONNX Runtime's GPU provider needs, found and checked before a GPU session is created.

onnxruntime-training 1.19.2's CUDA provider (``libonnxruntime_providers_cuda.so``) links the
CUDA 11.8 libraries (cudart 11, cuBLAS 11, cuDNN 8, cuFFT 10, cuRAND 10). When one of them
is missing, ONNX Runtime silently runs the session on the CPU; when they all load but the
NVIDIA driver (``libcuda.so.1``) does not, a static initializer of the provider library
aborts the whole process. So before the first CUDA session:

1. the libraries of the ``cuda`` install extra (NVIDIA's wheels, ``pip install 'orttrainer[cuda]'``)
   are loaded from their package folders, globally, so that ONNX Runtime finds them by name;
2. every library the provider needs (its ELF ``NEEDED`` entries) and the driver must load,
   or the error names the ones that do not and how to install them.
"""

import ctypes
import functools
import importlib.util
import struct
from pathlib import Path

import onnxruntime

CUDA_PROVIDER = "CUDAExecutionProvider"
DRIVER_LIBRARY = "libcuda.so.1"
PROVIDER_LIBRARIES = {
    "CUDAExecutionProvider": "libonnxruntime_providers_cuda.so",
    "ROCMExecutionProvider": "libonnxruntime_providers_rocm.so",
}
# (package, file) of the `cuda` extra, in dependency order: libcublas needs libcublasLt, the others only the system
EXTRA_LIBRARIES = (
    ("nvidia.cuda_runtime", "libcudart.so.11.0"),
    ("nvidia.cublas", "libcublasLt.so.11"),
    ("nvidia.cublas", "libcublas.so.11"),
    ("nvidia.cufft", "libcufft.so.10"),
    ("nvidia.curand", "libcurand.so.10"),
    ("nvidia.cudnn", "libcudnn.so.8"),
)
INSTALL_HINT = (
    "install them with pip install 'orttrainer[cuda]' (NVIDIA's CUDA 11.8 and cuDNN 8 wheels; see docs/gpu.md), "
    "or install CUDA 11.8 and cuDNN 8 and put their lib folders on LD_LIBRARY_PATH"
)
_DT_NEEDED, _DT_RPATH, _DT_RUNPATH = 1, 15, 29
_SHT_DYNAMIC = 6


class GPULibraryError(RuntimeError):
    """A library ONNX Runtime's GPU provider needs does not load (named in the message, with the fix)."""


def provider_library(provider: str) -> Path:
    """Where the installed onnxruntime keeps ``provider``'s shared library."""
    return Path(onnxruntime.__file__).parent / "capi" / PROVIDER_LIBRARIES[provider]


def extra_library(package: str, file: str):
    """The path of ``file`` in the lib folder of an installed NVIDIA wheel ``package``, or None."""
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:  # the `nvidia` namespace package itself is absent
        return None
    folders = spec.submodule_search_locations if spec is not None else None
    return next((Path(folder) / "lib" / file for folder in folders or () if (Path(folder) / "lib" / file).exists()), None)


def extra_installed() -> bool:
    """Whether every library of the ``cuda`` extra is installed."""
    return all(extra_library(package, file) for package, file in EXTRA_LIBRARIES)


@functools.cache
def preload_extra() -> tuple:
    """Load the ``cuda`` extra's libraries that are installed, globally, in dependency order; return their paths.

    Loaded with RTLD_GLOBAL, a library satisfies later requests for its name (soname), so the
    provider library finds them although they are in no system folder. Done once per process.
    """
    paths = tuple(path for path in (extra_library(package, file) for package, file in EXTRA_LIBRARIES) if path)
    for path in paths:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    return paths


def _section_headers(elf, header: bytes):
    """(type, offset, size, link) of every section of a 64-bit little-endian ELF file."""
    section_offset = struct.unpack_from("<Q", header, 0x28)[0]
    entry_size, count = struct.unpack_from("<HH", header, 0x3A)
    elf.seek(section_offset)
    table = elf.read(entry_size * count)
    fields = (struct.unpack_from("<IIQQQQI", table, index * entry_size) for index in range(count))
    return [(kind, offset, size, link) for _, kind, _, _, offset, size, link in fields]


def dynamic_entries(path: Path):
    """(NEEDED names, RUNPATH/RPATH folders) of a shared library, read from its ELF dynamic section.

    Like ldd, but without loading the library (loading the CUDA provider can abort the process).
    """
    with open(path, "rb") as elf:
        header = elf.read(64)
        if header[:4] != b"\x7fELF" or header[4:6] != b"\x02\x01":
            raise ValueError(f"{path} is not a 64-bit little-endian ELF shared library")
        sections = _section_headers(elf, header)
        _, dynamic_offset, dynamic_size, strings_index = next(section for section in sections if section[0] == _SHT_DYNAMIC)
        elf.seek(dynamic_offset)
        dynamic = elf.read(dynamic_size)
        _, strings_offset, strings_size, _ = sections[strings_index]
        elf.seek(strings_offset)
        strings = elf.read(strings_size)

    def string(offset):
        return strings[offset : strings.index(b"\0", offset)].decode()

    tags = [struct.unpack_from("<qQ", dynamic, start) for start in range(0, len(dynamic) - 15, 16)]
    needed = [string(value) for tag, value in tags if tag == _DT_NEEDED]
    folders = [folder.replace("$ORIGIN", str(path.parent)) for tag, value in tags if tag in (_DT_RPATH, _DT_RUNPATH)
               for folder in string(value).split(":") if folder]  # fmt: skip
    return needed, folders


def load_error(name: str, folders=()):
    """Why the dynamic loader cannot load library ``name`` (found in ``folders`` or by the loader's own search), or None."""
    candidates = [str(Path(folder) / name) for folder in folders if (Path(folder) / name).exists()] + [name]
    error = None
    for candidate in candidates:
        try:
            ctypes.CDLL(candidate)
            return None
        except OSError as failure:
            error = failure
    return str(error)


def unresolved_dependencies(library: Path) -> dict:
    """{name: loader error} of the libraries ``library`` needs that do not load here."""
    needed, folders = dynamic_entries(library)
    errors = {name: load_error(name, folders) for name in needed}
    return {name: error for name, error in errors.items() if error is not None}


def _missing_libraries_error(provider: str, library: Path, missing: dict) -> GPULibraryError:
    names = ", ".join(missing)
    return GPULibraryError(
        f"ONNX Runtime's {provider} cannot load: {library.name} needs {names}, which do not load here "
        f"({next(iter(missing.values()))}); ONNX Runtime would run the session on the CPU instead. Fix: {INSTALL_HINT}"
    )


def check_provider_loads(provider: str) -> None:
    """Make sure creating a session with ``provider`` neither falls back to the CPU nor aborts the process.

    For CUDA the ``cuda`` extra's libraries are preloaded first; then every library the
    provider needs must load, and for CUDA the driver too. Raises GPULibraryError naming what does not.
    """
    library = provider_library(provider)
    if not library.exists():  # a build with the provider linked in: nothing separate to load
        return
    if provider == CUDA_PROVIDER:
        preload_extra()
    missing = unresolved_dependencies(library)
    if missing:
        raise _missing_libraries_error(provider, library, missing)
    if provider == CUDA_PROVIDER:
        driver_error = load_error(DRIVER_LIBRARY)
        if driver_error is not None:
            raise GPULibraryError(
                f"the NVIDIA driver library {DRIVER_LIBRARY} does not load ({driver_error}); without it {library.name} "
                "aborts the process when it loads. Fix: install the NVIDIA driver (>= 450.80.02 for CUDA 11.8), or in a "
                "container start it with GPU access (docker run --gpus all)"
            )
