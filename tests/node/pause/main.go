// The pod sandbox's process ("pause") for the tests' real node: it holds the pod's namespaces
// and reaps nothing (SIGCHLD ignored, so the kernel reaps) until SIGTERM or SIGINT. No registry
// is reachable from the tests, so this image is built here (scripts/node) and imported into
// containerd under the name its CRI configuration pins.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signal.Ignore(syscall.SIGCHLD)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	<-stop
}
