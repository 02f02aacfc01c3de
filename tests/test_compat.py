"""kubetron/compat: each adaptation of another library states the versions it was checked against; the
installed ones must be inside (a pin bumped past a range fails here, so the adaptations get re-checked),
and installing on any other version refuses in one line."""

from __future__ import annotations

import pytest
from kubetron import compat
from kubetron.compat import megatron_core
from kubetron.compat import torch as torch_compat

pytestmark = pytest.mark.unit

CHECKED = {"megatron-core": megatron_core.CHECKED, "torch": torch_compat.CHECKED}


@pytest.mark.parametrize("distribution", sorted(CHECKED))
def test_the_installed_version_is_one_the_adaptations_were_checked_against(distribution):
    compat.require_checked(distribution, CHECKED[distribution])


@pytest.mark.parametrize(("version", "checked"), [("2.11.0a0+git3f5e2b1", True), ("2.13.0+cpu", True),
                                                  ("2.10.1", False), ("2.14.0", False)])
def test_a_pre_release_or_local_build_counts_as_its_release(monkeypatch, version, checked):
    monkeypatch.setattr(compat, "installed_version", lambda distribution: version)
    if checked:
        compat.require_checked("torch", torch_compat.CHECKED)
    else:
        with pytest.raises(compat.UncheckedVersionError):
            compat.require_checked("torch", torch_compat.CHECKED)


@pytest.mark.parametrize(("distribution", "install"), [("megatron-core", megatron_core.install),
                                                       ("torch", lambda: torch_compat.compile_deferred().__enter__())])
def test_installing_on_an_unchecked_version_refuses_in_one_line(monkeypatch, distribution, install):
    monkeypatch.setattr(compat, "installed_version", lambda d: "99.0.0" if d == distribution else "0.16.1")
    with pytest.raises(compat.UncheckedVersionError) as refused:
        install()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{distribution}: 99.0.0 is installed;") and CHECKED[distribution] in message


def test_the_torchrun_launcher_refuses_an_unchecked_torch_in_one_line(monkeypatch, capsys):
    from kubetron.supervisor import torchrun

    monkeypatch.setattr(compat, "installed_version", lambda d: "2.20.0")
    assert torchrun.main(["--nproc-per-node", "1", "-m", "kubetron", "--help"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kubetron.torchrun: torch: 2.20.0 is installed;") and torch_compat.CHECKED in line


@pytest.mark.parametrize("distribution", sorted(CHECKED))
@pytest.mark.trainer
def test_the_library_entry_refuses_an_unchecked_version_before_it_runs(monkeypatch, distribution):
    """`pretrain()` / `finetune()` called from a script (not `kubetron train`) check the versions too."""
    from kubetron.training import entry

    from tests.inprocess import in_process_config

    checked = {"megatron-core": "0.16.1", "torch": "2.13.0"}
    monkeypatch.setattr(compat, "installed_version", lambda d: "99.0.0" if d == distribution else checked[d])
    started = []
    monkeypatch.setattr(entry, "_run", lambda *args, **kwargs: started.append(args))
    for call in (entry.pretrain, entry.finetune):
        with pytest.raises(compat.UncheckedVersionError, match=f"^{distribution}: 99.0.0 is installed"):
            call(in_process_config(), lambda state, data_iterator, model: None)
    assert started == []
