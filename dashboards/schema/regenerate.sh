#!/usr/bin/env bash
# Regenerates grafana-dashboard.schema.json: the JSON Schema of the `Dashboard` type that
# Grafana publishes in its @grafana/schema npm package (generated there from Grafana's CUE
# kinds; Apache-2.0), converted with ts-json-schema-generator. Needs node and npm.
set -euo pipefail
GRAFANA_SCHEMA_VERSION=${GRAFANA_SCHEMA_VERSION:-13.2.3}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
npm init -y >/dev/null
npm install --silent --no-audit --no-fund "@grafana/schema@$GRAFANA_SCHEMA_VERSION" ts-json-schema-generator@2.4.0 typescript@5
npx ts-json-schema-generator --no-type-check --type Dashboard \
  --path node_modules/@grafana/schema/dist/types/raw/dashboard/x/types.gen.d.ts \
  -o "$here/grafana-dashboard.schema.json"
echo "wrote $here/grafana-dashboard.schema.json from @grafana/schema@$GRAFANA_SCHEMA_VERSION"
