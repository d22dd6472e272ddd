"""On PYTHONPATH, Python imports this module at startup; it changes what a test's child process can import:
- RTP_BLOCKED_IMPORTS (comma-separated top-level packages): not found, as if not installed;
- RTP_FORBIDDEN_IMPORTS: found (a check that they are installed passes), but importing one fails, naming it.
A test of what a command imports, or of how it fails without a framework, runs the command with them."""
import os
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec


def names(variable):
    return {name for name in os.environ.get(variable, "").split(",") if name}


BLOCKED, FORBIDDEN = names("RTP_BLOCKED_IMPORTS"), names("RTP_FORBIDDEN_IMPORTS")


class Forbidden(Loader):
    def create_module(self, spec):
        raise ImportError(f"forbidden import of {spec.name} (the test says this command must not import it)")

    def exec_module(self, module):
        pass


class Finder(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top in BLOCKED:
            raise ModuleNotFoundError(f"No module named '{fullname}' (blocked by the test)", name=fullname)
        if top in FORBIDDEN:
            return ModuleSpec(fullname, Forbidden())
        return None


if BLOCKED or FORBIDDEN:
    sys.meta_path.insert(0, Finder())
