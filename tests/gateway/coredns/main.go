// CoreDNS with the plugins the Gateway API conformance suite's Corefile names (forward, log,
// errors, whoami): the suite's base manifests run it in gateway-conformance-infra, and every pod
// there must be ready before the suite starts. Built the way CoreDNS documents for a smaller
// binary: its coremain with the plugins imported by hand.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/whoami"
	"github.com/coredns/coredns/coremain"
)

func init() {
	dnsserver.Directives = []string{"log", "errors", "forward", "whoami"}
}

func main() {
	coremain.Run()
}
