"""The device layer of the JAX-free runtime: a PJRT plugin and client (`Device`), its buffers and executables,
the compile cache, and `Runner`, an artifact's entries, weights and pools on one device (or on the devices of its
mesh: sharded.py)."""

from .handles import Buffer, Executable
from .pjrt import CompileError, Device, DonationError, TooFewDevicesError
from .plugin import ENV_PLUGIN, PluginNotFoundError, bytecode_stablehlo_version, find_plugin
from .runner import Runner

__all__ = ["Buffer", "CompileError", "Device", "DonationError", "ENV_PLUGIN", "Executable", "PluginNotFoundError",
           "Runner", "TooFewDevicesError", "bytecode_stablehlo_version", "find_plugin"]
