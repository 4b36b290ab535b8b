// kube-scheduler with one extra plugin, Coscheduling (gang scheduling) from kubernetes-sigs/scheduler-plugins:
// the scheduler behind PDRollout's spec.gang in the tests (built by e2e/cluster/gang-scheduler.sh).
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-scheduler/app"

	"sigs.k8s.io/scheduler-plugins/pkg/coscheduling"

	_ "sigs.k8s.io/scheduler-plugins/apis/config/scheme" // the plugin's args types
)

func main() {
	os.Exit(cli.Run(app.NewSchedulerCommand(app.WithPlugin(coscheduling.Name, coscheduling.New))))
}
