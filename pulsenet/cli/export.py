"""``pulsenet export``: a verified policy version as a Hugging Face model directory.

Rebuilds version N (or the newest) of a channel through PULSESync's own reader (signed manifests
from trusted keys, the cheapest anchor + patch path, every tensor and the model digest verified:
``sync.chain``), checks the weights fit the model's architecture, and writes a directory that
``AutoModelForCausalLM.from_pretrained`` and vLLM load as they are: ``config.json`` (the model's,
or without ``--model`` the one a trainer signed into the channel's anchors; dtype bfloat16),
``model.safetensors`` (the verified BF16 weights; a tied ``lm_head`` once, as ``save_pretrained``
writes it), the tokenizer files and ``generation_config.json`` when ``--model`` has them, and
``pulsenet-export.json`` (store, channel, run, version, digest, signer). ``latest`` is the newest
version whose manifest verifies: a listed name is only a claim (``newest_verified``).

The written weights are read back and hashed: their model digest must be the signed one. Everything
is written to a temporary directory next to OUT and renamed into place last, so OUT is either absent
or complete; a wrong key, a tampered payload or a failed check writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pulsenet.cli import add_settings_command, command_settings
from pulsenet.cli.sync import StoreSettings
from pulsenet.settings import require

if TYPE_CHECKING:  # torch is imported when the command runs: `pulsenet --help` stays light
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from transformers import PretrainedConfig

    from pulsenet.rl.models import ModelRef
    from pulsenet.store.base import ObjectStore
    from pulsenet.sync.chain import ManifestReader
    from pulsenet.sync.manifest import Manifest

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ExportSettings(StoreSettings):
    """Rebuild a verified version (signature, payload SHA-256, model digest) and write it as a Hugging
    Face model directory OUT (config, tokenizer, safetensors), atomically; prints 'v<version> <digest> OUT'."""

    trust: list[Path] = field(default_factory=list)
    """Trusted publisher public keys (required)."""
    version: str = "latest"
    """Version to export: a number or latest."""
    out: Path | None = None
    """The model directory to create (required; must not exist, or be empty)."""
    model: str | None = None
    """Architecture and tokenizer of the run: tiny, smollm2, a Hugging Face directory or a cached hub id
    (None: the architecture the channel's anchor carries, signed; tiny for a channel that carries none)."""
    cache: Path | None = None
    """Payload cache (None: a temporary directory)."""
    threads: int | None = None
    """Codec threads (None: every core)."""


def register(sub: argparse._SubParsersAction) -> None:
    add_settings_command(sub, "export", "write a verified version as a Hugging Face model directory", "export", _export)


@dataclass(frozen=True, slots=True)
class Exported:
    version: int
    digest: str
    out: Path


def _export(ns: argparse.Namespace) -> int:
    from pulsenet.signing import trusted_keys
    from pulsenet.store import S3Config, open_store

    args = command_settings(ns, ExportSettings)
    require(args, "store", "trust", "out", table="export")
    out = args.out
    assert out is not None  # checked by require() above; tells the type checker
    trusted = trusted_keys(args.trust)

    async def go() -> Exported:
        async with open_store(args.store, S3Config.from_env(timeout_s=args.timeout)) as store:
            return await export_version(
                store,
                trusted,
                out=out,
                model=args.model,
                version=args.version,
                channel=args.channel,
                run=args.run,
                timeout_s=args.timeout,
                cache_dir=args.cache,
                threads=args.threads or os.cpu_count() or 2,
            )

    done = asyncio.run(go())
    print(f"v{done.version} {done.digest} {done.out}")
    return 0


async def export_version(
    store: ObjectStore,
    trusted: Mapping[str, Ed25519PublicKey],
    *,
    out: Path,
    model: str | None = None,
    version: str | int = "latest",
    channel: str = "policy",
    run: str = "default",
    timeout_s: float | None = None,
    cache_dir: Path | None = None,
    threads: int = 2,
) -> Exported:
    """Rebuild ``version`` of the channel, verified, and write it as a HF directory at ``out``.

    ``model``: the run's model (its architecture, tokenizer and generation config are written);
    None: the architecture signed into the anchor the version was rebuilt from (no tokenizer), or,
    for a channel published before anchors carried it, the tiny model."""
    import tempfile

    from pulsenet.errors import ConfigError, ObjectNotFound, VerificationError
    from pulsenet.rl.models import ModelRef, check_layout_matches, model_hf_config, resolve_model
    from pulsenet.sync.chain import ManifestReader, PayloadCache, candidate_paths, check_cache_dir, rebuild
    from pulsenet.sync.layout import Layout

    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory: export writes a new one")
    if cache_dir is not None:
        check_cache_dir(cache_dir, out, cache_flag="--cache", other_flag="--out", inside=False)
    ref = resolve_model(model) if model is not None else None
    hf_config = model_hf_config(ref) if ref is not None else None  # a bad model setting fails before any download
    layout = Layout(channel, run=run, store_url=store.url)
    reader = ManifestReader(store, layout, trusted, timeout_s)
    if str(version) == "latest":
        manifest = await newest_verified(reader)
    else:
        try:
            target_version = int(version)
        except ValueError:
            raise ConfigError(f"version must be a number or latest, got {version!r}") from None
        manifest = await reader.get(target_version)  # signature by a trusted key, or an error
    target_version = manifest.version
    with contextlib.ExitStack() as stack:
        root = cache_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pulsenet-export-")))
        cache = PayloadCache(store, Path(root), timeout_s=timeout_s)
        bad: set[str] = set()
        state: dict[str, torch.Tensor] | None = None
        last: BaseException | None = None
        for path in await candidate_paths(reader, manifest, None, bad):
            try:
                state = await rebuild(path, cache, None, threads=threads, bad=bad)
                anchor = path.steps[0].manifest  # export rebuilds from nothing: an anchor path
                break
            except (ObjectNotFound, VerificationError) as e:
                last = e
        if state is None:
            raise last or VerificationError(f"v{target_version}: no anchor path to rebuild it from")
    if ref is None or hf_config is None:  # no --model (both None together; naming both narrows the types)
        ref = ModelRef("tiny", None)
        if anchor.model_config is not None:
            hf_config = channel_hf_config(anchor.model_config, f"v{anchor.version}")
            ref = ModelRef(f"{hf_config.model_type} (from the channel)", None)
        else:
            try:
                check_layout_matches(model_hf_config(ref), state, what=f"v{target_version}")
            except ConfigError as e:
                raise ConfigError(
                    f"anchor v{anchor.version} carries no architecture (published before channels did), so the tiny "
                    f"model was assumed and {e}: pass --model (the run's model: smollm2, a Hugging Face directory or a hub id)"
                ) from None
            hf_config = model_hf_config(ref)
    check_layout_matches(hf_config, state, what=f"v{target_version}")
    await asyncio.to_thread(_write_dir, out, state, manifest.model_digest, ref, hf_config, {
        "store": store.url,
        "channel": channel,
        "run": run,
        "version": target_version,
        "digest": manifest.model_digest,
        "publisher": manifest.publisher,
        "model": model if model is not None else ref.name,
    })
    return Exported(target_version, manifest.model_digest, out)


def channel_hf_config(config: Mapping, where: str) -> PretrainedConfig:
    """The transformers config of a ``model_config`` a trusted key signed into a manifest; a
    ConfigError naming ``where`` and ``--model`` if transformers cannot make a causal LM of it."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from pulsenet.errors import ConfigError

    model_type = config.get("model_type")
    if not isinstance(model_type, str) or (
        model_type not in CONFIG_MAPPING or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    ):
        raise ConfigError(
            f"{where}'s model_config names model_type {str(model_type)[:80]!r}, not a causal LM this transformers "
            "can build: pass --model"
        )
    try:
        return CONFIG_MAPPING[model_type].from_dict(dict(config))
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ConfigError(f"{where}'s model_config does not build a {model_type} config ({e}): pass --model") from None


async def newest_verified(reader: ManifestReader) -> Manifest:
    """The newest manifest of the channel that a trusted key signed. A listed name is only a claim
    (anyone who can write the bucket can plant ``v999999999999.json``): names are tried newest
    first, and one whose manifest is refused (malformed, untrusted, another version's copy, gone) is
    logged and passed over. When none verifies: the oldest one's error (its type: SignatureError
    for a channel of another key), saying how many were refused; ObjectNotFound for no names."""
    from pulsenet.errors import ManifestError, ObjectNotFound

    listed = await reader.list_versions()
    where = f"{reader.store.url} channel {reader.layout.channel!r}"
    if not listed:
        raise ObjectNotFound(f"no published versions in {where}")
    last: ManifestError | ObjectNotFound = ObjectNotFound(where)  # replaced by the first refusal below
    for n, v in enumerate(sorted(listed, reverse=True)):
        try:
            return await reader.get(v, info=listed[v])
        except (ManifestError, ObjectNotFound) as e:
            last = e
            if n < 3:
                log.warning("export: passing over manifest v%d: %s: %s", v, type(e).__name__, e)
    raise type(last)(
        f"no version in {where} verifies under the trusted keys ({len(listed)} refused; the oldest, "
        f"v{min(listed)}: {last})"
    )


def _write_dir(
    out: Path, state: Mapping[str, torch.Tensor], digest: str, ref: ModelRef, hf_config: PretrainedConfig, info: dict
) -> None:
    """Write everything into a sibling temporary directory, check the weights' digest, rename into place."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pulsenet.codec.digest import model_digest_from_records, tensor_record, tensor_sha256
    from pulsenet.codec.dtypes import dtype_name
    from pulsenet.errors import VerificationError
    from pulsenet.fsutil import fsync_path
    from pulsenet.rl.models import model_tokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        config = hf_config.__class__.from_dict(hf_config.to_dict())
        config.dtype = torch.bfloat16  # what the weights are
        config.save_pretrained(tmp)
        if ref.path is not None:
            if ref.has_tokenizer:
                model_tokenizer(ref).save_pretrained(tmp)
            gen = ref.path / "generation_config.json"
            if gen.is_file():
                shutil.copyfile(gen, tmp / "generation_config.json")
        weights = tmp / "model.safetensors"
        save_file({n: t.contiguous() for n, t in state.items()}, str(weights), metadata={"format": "pt"})
        records = {}
        with safe_open(str(weights), framework="pt") as f:  # read back: what a loader will see
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = f.get_tensor(name)
                records[name] = tensor_record(name, dtype_name(t.dtype), t.shape, tensor_sha256(t))
        written = model_digest_from_records(records)
        if written != digest:
            raise VerificationError(f"the written weights hash to {written[:16]}…, not the signed {digest[:16]}…")
        (tmp / "pulsenet-export.json").write_text(json.dumps(info, indent=1) + "\n")
        for p in tmp.iterdir():
            fsync_path(p)
        fsync_path(tmp)
        if out.exists():  # an empty directory (checked by the caller): rename replaces it
            out.rmdir()
        os.replace(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
