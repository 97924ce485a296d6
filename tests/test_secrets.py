"""Credentials in storage options never show in text: reprs, strs, f-strings, type errors and error messages;
the real values still reach fsspec and s3fs (a moto server that checks signatures accepts them)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import nvcomp_checkpoint as nc
from conftest import assert_tree_equal, environ_set, start_moto_server
from nvcomp_checkpoint.credentials import REDACTED, StorageOptions, is_secret_key, redacted
from nvcomp_checkpoint.errors import CheckpointError
from nvcomp_checkpoint.saveoptions import SaveOptions
from nvcomp_checkpoint.tiers import TierCopies

SECRET = "s3cr3t-" + uuid.uuid4().hex
ENDPOINT = "http://127.0.0.1:9"  # not a credential: shown
CREDENTIALS: dict[str, Any] = {
    "key": SECRET + "-key",
    "secret": SECRET + "-secret",
    "token": SECRET + "-token",
    "password": SECRET + "-password",
    "session_token": SECRET + "-session",
    "client_kwargs": {
        "endpoint_url": ENDPOINT,
        "aws_secret_access_key": SECRET + "-aws",
        "aws_session_token": SECRET + "-aws-session",
    },
    "headers": [{"Authorization": "Bearer " + SECRET}],
    "connection_string": f"AccountName=a;AccountKey={SECRET}",
    "anon": False,
}


def _texts(value: Any) -> list[str]:
    """Every way a value ends up as text in a log line, an error or a notebook."""
    return [repr(value), str(value), f"{value}", f"{value!r}", f"{value:}", "%s" % (value,), "%r" % (value,), format(value)]  # noqa: UP031


def _assert_hidden(value: Any) -> None:
    for text in _texts(value):
        assert SECRET not in text, text


def test_secret_keys_are_the_credentials_of_fsspec_back_ends() -> None:
    for name in ("key", "secret", "token", "password", "session_token", "aws_secret_access_key", "aws_access_key_id",
                 "account_key", "sas_token", "connection_string", "client_secret", "credential", "Authorization"):  # fmt: skip
        assert is_secret_key(name), name
    for name in ("endpoint_url", "anon", "region_name", "default_block_size", "config_kwargs", "skip_instance_cache"):
        assert not is_secret_key(name), name
    shown = redacted(CREDENTIALS)
    assert shown["client_kwargs"] == {"endpoint_url": ENDPOINT, "aws_secret_access_key": REDACTED, "aws_session_token": REDACTED}
    assert shown["headers"] == [{"Authorization": REDACTED}] and shown["anon"] is False
    assert SECRET not in repr(shown)
    assert CREDENTIALS["key"] == SECRET + "-key"  # the caller's dict is not changed


def test_storage_options_show_no_credential_and_keep_every_value() -> None:
    options = StorageOptions(CREDENTIALS)
    _assert_hidden(options)
    assert ENDPOINT in repr(options)  # what is not a credential stays readable
    assert dict(options) == CREDENTIALS and options["secret"] == SECRET + "-secret"  # the real values, for fsspec
    assert {**options} == CREDENTIALS
    back = pickle.loads(pickle.dumps(options))  # a spawned process must still authenticate
    assert type(back) is StorageOptions and dict(back) == CREDENTIALS
    _assert_hidden(back)
    assert StorageOptions.of(None) is None and StorageOptions.of(options) is options


def test_tier_hides_credentials_in_every_text_form(tmp_path: Path) -> None:
    tier = nc.Tier(tmp_path / "t", keep=2, storage_options=CREDENTIALS)
    _assert_hidden(tier)
    _assert_hidden(tier.storage_options)
    _assert_hidden(dataclasses.asdict(tier))
    _assert_hidden(dataclasses.replace(tier, keep=3))
    _assert_hidden(tier.write_options())
    assert "storage_options=" in repr(tier) and ENDPOINT in repr(tier)
    assert tier.storage_options == CREDENTIALS  # the values fsspec gets
    back = pickle.loads(pickle.dumps(tier))  # TierCopies sends tiers to Lightning's spawned processes
    assert back.storage_options == CREDENTIALS
    _assert_hidden(back)


def test_manager_tiers_hide_credentials(tmp_path: Path) -> None:
    tiers = [nc.Tier(tmp_path / "fast"), nc.Tier(tmp_path / "slow", every_steps=2, storage_options=CREDENTIALS)]
    with nc.CheckpointManager(tiers, async_save=False) as mgr:
        _assert_hidden(mgr.tiers)
        _assert_hidden(vars(mgr))
        mgr.save(2, {"w": torch.arange(8.0)})
    assert (tmp_path / "slow" / "step-0000000002.nvc").is_file()


def test_save_options_hide_credentials() -> None:
    options = SaveOptions.of("x.nvc", "save", metadata={"note": "x"}, storage_options=CREDENTIALS)
    _assert_hidden(options)
    _assert_hidden(options.storage_options)
    assert options.storage_options == CREDENTIALS


@pytest.mark.parametrize("make", [lambda tiers: TierCopies(tiers, "Owner(tiers=...)"), nc.CheckpointManager])
def test_a_dict_given_as_a_tier_is_refused_without_its_credentials(tmp_path: Path, make: Any) -> None:
    as_dict = {"url": "s3://bucket/run", "storage_options": CREDENTIALS}
    tiers = [nc.Tier(tmp_path / "a"), as_dict]
    with pytest.raises(TypeError, match="nvcomp_checkpoint.Tier") as info:
        make(tiers)
    assert SECRET not in str(info.value) and "s3://bucket/run" in str(info.value)


def test_lightning_plugin_options_hide_credentials() -> None:
    pytest.importorskip("lightning")
    from nvcomp_checkpoint.lightning import NvcompCheckpointIO

    plugin = NvcompCheckpointIO(fsspec_options=CREDENTIALS, incremental=True)
    _assert_hidden(plugin.fsspec_options)
    _assert_hidden(plugin.incremental.storage_options)  # type: ignore[union-attr]
    _assert_hidden(vars(plugin))
    assert plugin.fsspec_options == CREDENTIALS


# -- the real values reach s3fs ---------------------------------------------------------------
BUCKET = "secret-checkpoints"


@pytest.fixture(scope="module")
def signed_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """moto's S3 server checking every request's signature (after the 4 unsigned set-up calls): an IAM
    user with S3 rights, its access key and a bucket. Yields the endpoint and the user's key and secret."""
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    boot = {"AWS_ACCESS_KEY_ID": "boot", "AWS_SECRET_ACCESS_KEY": "boot", "AWS_DEFAULT_REGION": "us-east-1"}
    env = dict(os.environ, **boot, INITIAL_NO_AUTH_ACTION_COUNT="4")
    proc, port = start_moto_server(env, tmp_path_factory.mktemp("moto") / "moto_server.log")
    # nothing ever reaches real AWS credentials
    with environ_set(boot):
        try:
            endpoint = f"http://127.0.0.1:{port}"
            iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1")
            iam.create_user(UserName="trainer")
            policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
            iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName="trainer")["AccessKey"]
            s3 = boto3.client(
                "s3",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id=key["AccessKeyId"],
                aws_secret_access_key=key["SecretAccessKey"],
            )
            s3.create_bucket(Bucket=BUCKET)
            yield {"endpoint": endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        finally:
            proc.kill()
            proc.wait()


def _options(s3: dict[str, Any], secret: str | None = None) -> dict[str, Any]:
    return {
        "key": s3["key"],
        "secret": s3["secret"] if secret is None else secret,
        "client_kwargs": {"endpoint_url": s3["endpoint"]},
        "skip_instance_cache": True,
    }


def test_save_and_load_on_s3_sign_with_the_real_secret(signed_s3: dict[str, Any]) -> None:
    state = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(0)), "step": 3}
    url = f"s3://{BUCKET}/api/ckpt.nvc"
    nc.save(state, url, storage_options=StorageOptions(_options(signed_s3)))
    assert_tree_equal(nc.load(url, storage_options=_options(signed_s3)), state)
    # A wrong secret is refused by the server: proof that the secret given is the one that signs.
    wrong = "wrong-" + SECRET
    with pytest.raises(CheckpointError) as info:
        nc.save(state, f"s3://{BUCKET}/api/other.nvc", storage_options=_options(signed_s3, wrong))
    assert "signature" in str(info.value).lower() and wrong not in str(info.value)


def test_manager_copies_to_an_s3_tier_and_restores_with_the_real_secret(signed_s3: dict[str, Any], tmp_path: Path) -> None:
    remote = nc.Tier(f"s3://{BUCKET}/run", storage_options=_options(signed_s3))
    assert signed_s3["secret"] not in repr(remote)
    state = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(1)), "step": 4}
    with nc.CheckpointManager([nc.Tier(tmp_path / "local"), remote], async_save=False) as mgr:
        mgr.save(4, state)
        mgr.wait()
        assert signed_s3["secret"] not in repr(mgr.tiers)
    with nc.CheckpointManager([nc.Tier(tmp_path / "fresh"), remote], async_save=False) as fresh:
        restored = fresh.restore()
    assert restored is not None and restored.step == 4
    assert_tree_equal(restored.state, state)
