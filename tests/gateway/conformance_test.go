// The Gateway API conformance suite, as its module ships it, run against ebb: `go test -c` makes
// the binary the kube tests run (tests/gateway.rs), with the suite's own flags
// (-gateway-class, -supported-features, -conformance-profiles, -report-output, ...).
package gateway

import (
	"testing"

	"sigs.k8s.io/gateway-api/conformance"
)

func TestConformance(t *testing.T) {
	conformance.RunConformance(t)
}
