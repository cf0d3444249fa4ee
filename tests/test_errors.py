"""One error hierarchy (issue 15): every exception a user can meet is a FabricError, and the
command lines map its kinds to their exit codes."""
import importlib
import inspect
import pkgutil

import fabric_ext
from fabric_ext.runtime.machine.errors import FabricError, InputError

#: exceptions that never leave the machine: a backend turns them into a VMFault with the pc
INTERNAL = {"Fault", "_ProofViolation"}


def project_exceptions():
    for pkg in ("fabric_ext", "fabric_ext.contract", "fabric_ext.codegen", "fabric_ext.runtime", "fabric_ext.runtime.machine",
                "fabric_ext.runtime.simulation"):
        mod = importlib.import_module(pkg)
        for info in pkgutil.iter_modules(mod.__path__):
            m = importlib.import_module(f"{pkg}.{info.name}")
            for name, obj in vars(m).items():
                if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == m.__name__:
                    yield name, obj


def test_every_project_exception_is_a_fabric_error():
    found = dict(project_exceptions())
    assert {"VerifierError", "BundleError", "WorkloadError", "ObjectError", "PolicyError", "VMFault"} <= set(found)
    loose = [name for name, cls in found.items() if name not in INTERNAL and not issubclass(cls, FabricError)]
    assert not loose, loose
    assert issubclass(fabric_ext.PolicyError, InputError)


def test_an_input_error_of_any_kind_exits_1(tmp_path, capsys):
    """A folder whose manifest is not JSON (an ArtifactError) and an unknown model (a
    WorkloadError) reach fabric-run's one handler for input errors."""
    from fabric_ext.runtime.simulation import cli
    (tmp_path / "manifest.json").write_text("{")
    assert cli.main(["--policy", str(tmp_path), "-q"]) == 1
    assert cli.main(["--model", "llama3-7b", "-q"]) == 1
    err = capsys.readouterr().err
    assert "corrupt manifest.json" in err and "unknown model 'llama3-7b'" in err and "internal error" not in err
