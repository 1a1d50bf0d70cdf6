"""The local sandbox backend (built in): scratch dirs, rlimits, scrubbed env, and Linux
namespaces (bubblewrap, else util-linux unshare) when the kernel allows."""

from miles_engine.sandbox.local.options import LocalSandboxOptions

__all__ = ["LocalSandboxBackend", "LocalSandbox", "LocalSandboxOptions"]


def __getattr__(name: str):  # keep `import miles_engine.sandbox.local.plugin` light
    if name == "LocalSandboxBackend":
        from miles_engine.sandbox.local.backend import LocalSandboxBackend

        return LocalSandboxBackend
    if name == "LocalSandbox":
        from miles_engine.sandbox.local.sandbox import LocalSandbox

        return LocalSandbox
    raise AttributeError(name)
