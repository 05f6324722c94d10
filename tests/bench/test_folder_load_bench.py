"""The folder-load benchmark cannot rot: each load runs in this process on a tiny folder (its
children would run the same ``child``), and the table reads its figures as ratios to raw."""

from __future__ import annotations

from benchmarks import folder_load


def test_every_load_reads_the_whole_folder_and_the_table_reads_ratios(tmp_path) -> None:
    folder = tmp_path / "qwen2"
    folder_load.write_folder(folder, hidden=64, layers=2)
    files = folder_load.shards(folder)
    nbytes = sum(f.stat().st_size for f in files)
    assert files and nbytes > 0
    runs = {}
    for system in folder_load.SYSTEMS:
        folder_load.drop_cache(files)
        run = folder_load.child(system, folder)
        assert run["bytes"] == nbytes and run["seconds"] > 0, system
        runs[system] = [run]
    assert folder_load._raw(files) == nbytes  # O_DIRECT reads every byte, the tails too
    runs["raw"] = [{"seconds": 1.0, "bytes": nbytes}]
    runs["from_pretrained"] = [{"seconds": 2.0, "bytes": nbytes}]
    table = folder_load.table(runs)
    assert "| raw O_DIRECT read | 1.00 |" in table and "| 1.00x |" in table
    assert "| from_pretrained | 2.00 |" in table and "0.50x |" in table
