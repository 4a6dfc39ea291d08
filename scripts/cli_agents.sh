#!/usr/bin/env bash
# Claude Code and the Codex CLI, each run once headless against `conveyor serve` (the default model): Claude Code
# over the Anthropic Messages API, Codex over the Responses API. Not part of CI: it installs both from npm into a
# directory of its own (node >= 20), and each run is bounded (timeout). What happened is recorded in
# docs/server.md ("Claude Code and Codex").
#
#   bash scripts/cli_agents.sh [PORT]        # a server is started on PORT (default 8620) and stopped at the end
# $CONVEYOR: the conveyor command (default .venv/bin/conveyor); $CLI_AGENTS_PREFIX: an npm prefix to reuse.
set -uo pipefail
cd "$(dirname "$0")/.."
PORT=${1:-8620}
WORK=$(mktemp -d -t conveyor-cli-agents-XXXX)
PREFIX=${CLI_AGENTS_PREFIX:-$WORK/npm}
MODEL=SmolLM2-135M-Instruct
URL=http://127.0.0.1:$PORT

npm install --silent --prefix "$PREFIX" @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 || exit 1
XDG_STATE_HOME=$WORK/state ${CONVEYOR:-.venv/bin/conveyor} serve --host 127.0.0.1 --port "$PORT" \
    > "$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 180); do curl -sf "$URL/health" > /dev/null && break; sleep 1; done
curl -sf "$URL/health" > /dev/null || { echo "the server did not start:"; tail -20 "$WORK/serve.log"; exit 1; }

export HOME=$WORK/home  # the CLIs' settings and sessions stay in the scratch directory
mkdir -p "$HOME" "$WORK/project"
cd "$WORK/project"
ASK="What is the capital of France? Answer in one word."

echo "== Claude Code, its own system prompt and tools"
timeout 300 env ANTHROPIC_BASE_URL=$URL ANTHROPIC_API_KEY=local ANTHROPIC_MODEL=$MODEL \
    ANTHROPIC_DEFAULT_HAIKU_MODEL=$MODEL CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 \
    "$PREFIX/node_modules/.bin/claude" -p "$ASK" --model $MODEL --output-format json | cut -c1-2000
echo
echo "== Claude Code, a short system prompt and one tool (Read)"
timeout 300 env ANTHROPIC_BASE_URL=$URL ANTHROPIC_API_KEY=local ANTHROPIC_MODEL=$MODEL \
    ANTHROPIC_DEFAULT_HAIKU_MODEL=$MODEL CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 \
    CLAUDE_CODE_MAX_OUTPUT_TOKENS=256 "$PREFIX/node_modules/.bin/claude" -p "$ASK" --bare --model $MODEL \
    --system-prompt "You are a helpful assistant." --tools Read --output-format json | cut -c1-2000
echo
CODEX=("$PREFIX/node_modules/.bin/codex" exec --skip-git-repo-check --ephemeral -m $MODEL
       -c model_provider=conveyor -c model_providers.conveyor.name=conveyor
       -c model_providers.conveyor.base_url=$URL/v1 -c model_providers.conveyor.wire_api=responses
       -c model_providers.conveyor.env_key=CONVEYOR_KEY -c model_providers.conveyor.request_max_retries=0)
echo "== Codex, its default tools"
timeout 300 env CONVEYOR_KEY=local "${CODEX[@]}" "$ASK" 2>&1 | tail -4
echo "== Codex, without hosted web search and sub-agents"
timeout 300 env CONVEYOR_KEY=local "${CODEX[@]}" --disable goals --disable multi_agent -c web_search=disabled \
    "$ASK" 2>&1 | tail -4
echo "== the server's log: the requests"
grep -E '"POST /v1/(messages|responses)' "$WORK/serve.log" | sort | uniq -c
