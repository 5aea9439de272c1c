"""narrows-lmhead installs alone (with only narrows-core) and joins the namespace."""

import narrows.lmhead
from narrows.core.testing.packaging import check_package_alone


def test_installed_alone_and_in_the_namespace():
    check_package_alone("lmhead")
    assert narrows.lmhead.__version__ == "0.1.0"
