"""ci.releases: which releases an install takes."""
from ci import releases


def test_when_boundaries_are_left_out_then_only_the_release_set_is_installed(monkeypatch):
    installed: list[str] = []
    monkeypatch.setattr(releases, "is_installed", lambda release: False)
    monkeypatch.setattr(releases, "install", installed.append)
    monkeypatch.setattr(releases, "write_kernel", lambda release: None)
    releases.install_all(jobs=1, boundaries=False)
    assert installed == list(releases.load().releases)
    installed.clear()
    releases.install_all(jobs=1)
    assert installed == [*releases.load().releases, *releases.sample_releases()]
    assert releases.sample_releases(), "the record has boundary releases outside the set, so the two differ"
