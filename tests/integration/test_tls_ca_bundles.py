"""CA files as distributed: a bundle with comments in UTF-8 between its certificates works
as --tls-ca / tls_ca, as it does for gRPC."""

from __future__ import annotations

import numpy as np
import pytest

from ps_common.certs import make_certs
from ps_common.tls import TLS
from ps_server.testing import InProcessCluster
from ps_worker import PSClient

# How certifi's cacert.pem (and other distributed CA bundles) look: each certificate after
# comments that name it, some names in UTF-8.
CERTIFI_STYLE_HEADER = ("\n# Issuer: CN=NetLock Arany (Class Gold) Főtanúsítvány O=NetLock Kft.\n"
                        "# Subject: CN=NetLock Arany (Class Gold) Főtanúsítvány\n"
                        "# Label: \"NetLock Arany (Class Gold) Főtanúsítvány\"\n").encode()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    out = tmp_path_factory.mktemp("certs")
    make_certs(out)
    return out


@pytest.fixture(scope="module")
def tls_cluster(certs):
    tls = TLS.from_files(ca=certs / "ca.pem", cert=certs / "server.pem",
                         key=certs / "server-key.pem")
    with InProcessCluster(servers=1, tls=tls) as cluster:
        yield cluster


def test_a_ca_bundle_with_utf8_comments_still_works(tls_cluster, certs, tmp_path):
    """A bundle in certifi's format (comments with UTF-8 names before each certificate) is
    what gRPC reads; the check that a file holds certificates decoded all of it as ASCII
    and failed with a TypeError traceback."""
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(CERTIFI_STYLE_HEADER + (certs / "ca.pem").read_bytes())
    with PSClient(tls_cluster.coordinator_address, tls_ca=bundle) as ps:
        ps.declare("w_bundle", shape=(4, 2), dtype="float32",
                   init={"name": "constant", "value": 1.0}, optimizer={"name": "sgd", "lr": 0.5},
                   seed=0)
        ps.push({"w_bundle": np.ones((4, 2), np.float32)})
        np.testing.assert_array_equal(ps.pull("w_bundle"), np.full((4, 2), 0.5, np.float32))

