// The Kubernetes control plane for ebb's tests, built from the k8s.io/kubernetes Go module as
// one program that runs one component per process, chosen by the name it is called by (a
// link named after the component) or by its first argument:
//
//	controlplane kube-apiserver --etcd-servers=... ...
//	controlplane kube-controller-manager --kubeconfig=... ...
//	controlplane kube-scheduler --kubeconfig=... ...
//	controlplane kubelet --config=... ...
//	controlplane kube-proxy --config=... ...
//	controlplane kubectl get pods
//
// The components share most of their code, so one program links once and takes a fraction of
// the disk of four (the kubelet and kube-proxy, which the tests run on a real node, add a few hundred packages). etcd is built beside it, from its own module (see go.mod's tool line).
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	_ "time/tzdata" // the controller manager's CronJob time zones

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

var components = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
	"kubelet":                 func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
	"kube-proxy":              proxy.NewProxyCommand,
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, known := components[name]; !known && name != "kubectl" {
		if len(os.Args) < 2 {
			usage()
		}
		name = os.Args[1]
		os.Args = os.Args[1:]
	}
	if name == "kubectl" {
		logs.GlogSetter(kubectl.GetLogVerbosity(os.Args)) //nolint:errcheck
		if err := cli.RunNoErrOutput(kubectl.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
		return
	}
	command, known := components[name]
	if !known {
		usage()
	}
	os.Exit(cli.Run(command()))
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: controlplane kube-apiserver|kube-controller-manager|kube-scheduler|kubelet|kube-proxy|kubectl [flags]")
	os.Exit(2)
}
