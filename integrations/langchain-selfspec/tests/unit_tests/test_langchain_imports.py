from langchain_selfspec import __all__

EXPECTED_ALL = ["ChatSpeculative", "__version__"]


def test_all_imports() -> None:
    assert sorted(EXPECTED_ALL) == sorted(__all__)


def test_version_is_the_distribution_version() -> None:
    from importlib.metadata import version

    import langchain_selfspec

    assert langchain_selfspec.__version__ == version("langchain-selfspec")
