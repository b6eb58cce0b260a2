"""What a process that cannot join the run's Ray cluster is told (producer/fleet/actors.py
``join_hint``): the token only when the error is about it; a GCS address that times out
points at Ray Client, which a driver in a container or pod of its own needs."""

from __future__ import annotations

from rollstream.producer.fleet.actors import is_client_address, join_hint


def test_a_gcs_address_that_times_out_points_at_ray_client_not_at_the_token() -> None:
    # what Ray 2.60 says after 60 s when no raylet of the cluster is in this process's view
    hint = join_hint("ray-head:6380", ConnectionError("Failed to connect to Ray cluster at ray-head:6380"))
    assert "ray://" in hint
    assert "refused" not in hint


def test_an_authentication_error_names_the_token() -> None:
    hint = join_hint("ray-head:6380", RuntimeError("UNAUTHENTICATED: invalid auth token"))
    assert "RAY_AUTH_TOKEN" in hint and "refused" in hint
    assert "ray://" not in hint


def test_a_ray_client_address_that_fails_names_the_client_server() -> None:
    hint = join_hint("ray://ray-head:10001", ConnectionError("ray client connection timeout"))
    assert "--ray-client-server-port" in hint and "ray[default]" in hint


def test_a_local_cluster_gets_no_hint() -> None:
    assert join_hint("", RuntimeError("no")) == ""


def test_only_ray_urls_are_client_addresses() -> None:
    assert is_client_address("ray://head:10001")
    assert not is_client_address("head:6380")
    assert not is_client_address("")
