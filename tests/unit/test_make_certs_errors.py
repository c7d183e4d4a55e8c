"""`ps-ctl make-certs` with a bad flag stops with a usage error naming it (exit 2), as every
command does (ps_common.cli), before writing anything: an --out that cannot be a directory,
a --days whose end date is past the year 9999, a --hosts name the certificate cannot hold
as it is (not ASCII)."""

from __future__ import annotations

import pytest

from ps_worker import ctl


@pytest.mark.parametrize("case", ["out-is-a-file", "days-past-9999", "non-ascii-host"])
def test_a_bad_make_certs_flag_is_a_usage_error_naming_it(case, tmp_path, capsys):
    out = tmp_path / "certs"
    if case == "out-is-a-file":
        out.write_text("not a directory")
        argv, flag = ["make-certs", "--out", str(out)], "--out"
    elif case == "days-past-9999":
        argv, flag = ["make-certs", "--out", str(out), "--days", "10000000"], "--days"
    else:
        argv, flag = ["make-certs", "--out", str(out), "--hosts", "bücher.example"], "--hosts"
    with pytest.raises(SystemExit) as stopped:
        ctl.main(argv)
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert flag in err, err
    assert "Traceback" not in err
    if case != "out-is-a-file":  # nothing written: not even an empty --out directory
        assert not out.exists()


def test_an_out_under_a_file_is_a_usage_error_naming_it(tmp_path, capsys):
    parent = tmp_path / "file"
    parent.write_text("not a directory")
    with pytest.raises(SystemExit) as stopped:
        ctl.main(["make-certs", "--out", str(parent / "certs")])
    assert stopped.value.code == 2
    assert "--out" in capsys.readouterr().err
