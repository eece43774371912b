//go:build tools

// The HTTP/2 conformance suite the tests run against ebb's own HTTP/2 (scripts/h2spec builds
// its command from the version pinned in go.mod).
package tools

import _ "github.com/summerwind/h2spec/cmd/h2spec"
