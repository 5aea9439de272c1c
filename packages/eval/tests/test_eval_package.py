"""narrows-eval installs alone (with only narrows-core) and joins the namespace."""

import narrows.eval
from narrows.core.testing.packaging import check_package_alone


def test_installed_alone_and_in_the_namespace():
    check_package_alone("eval")
    assert narrows.eval.__version__ == "0.1.0"
