// fakenodes stands in for the kubelets of the local cluster's fake GPU nodes: it keeps each node
// whose annotation selects it Ready (status heartbeat and node Lease), starts each pod bound to one
// (Running and Ready, containers running, init containers completed, a pod IP from the node's
// podCIDR) and removes a pod the API server marks for deletion. No container ever runs: the tests
// that need a process start it themselves from the pod (e2e/harness/pod_launch.py).
//
// A pod's status is written once, when it has no pod IP yet; what a test patches in later (a
// failed phase, a restarted container) stays, as a kubelet's report would.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	listersv1 "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/ptr"
)

const leaseNamespace = "kube-node-lease"

type agent struct {
	client     kubernetes.Interface
	nodes      listersv1.NodeLister
	pods       listersv1.PodLister
	queue      workqueue.TypedRateLimitingInterface[string]
	key, value string // the annotation that marks a node as ours

	mu     sync.Mutex
	given  map[string]netip.Addr // pod UID -> IP given, until the pod is gone
	cursor map[string]int        // node -> the host number given last (IPs are handed out round)
}

func (a *agent) ours(node *corev1.Node) bool {
	return node != nil && node.Annotations[a.key] == a.value
}

func (a *agent) node(name string) *corev1.Node {
	n, err := a.nodes.Get(name)
	if err != nil || !a.ours(n) {
		return nil
	}
	return n
}

func internalIP(node *corev1.Node) string {
	for _, addr := range node.Status.Addresses {
		if addr.Type == corev1.NodeInternalIP {
			return addr.Address
		}
	}
	return ""
}

// podIP is the next free address of the node's podCIDR after the last one given there.
func (a *agent) podIP(node *corev1.Node, uid string) (netip.Addr, error) {
	prefix, err := netip.ParsePrefix(node.Spec.PodCIDR)
	if err != nil || !prefix.Addr().Is4() || prefix.Bits() < 16 {
		return netip.Addr{}, fmt.Errorf("node %s: podCIDR %q is not an IPv4 prefix of /16 or longer", node.Name, node.Spec.PodCIDR)
	}
	pods, err := a.pods.List(labels.Everything())
	if err != nil {
		return netip.Addr{}, err
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if ip, ok := a.given[uid]; ok {
		return ip, nil
	}
	used := map[netip.Addr]bool{}
	for _, ip := range a.given {
		used[ip] = true
	}
	for _, p := range pods {
		if ip, err := netip.ParseAddr(p.Status.PodIP); err == nil && p.Spec.NodeName == node.Name {
			used[ip] = true
		}
	}
	size := 1 << (32 - prefix.Bits())
	base := prefix.Masked().Addr().As4()
	first := uint32(base[0])<<24 | uint32(base[1])<<16 | uint32(base[2])<<8 | uint32(base[3])
	for step := 1; step < size-1; step++ {
		host := (a.cursor[node.Name]+step-1)%(size-2) + 1 // 1 .. size-2: not the network nor broadcast
		n := first + uint32(host)
		ip := netip.AddrFrom4([4]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)})
		if !used[ip] {
			a.cursor[node.Name] = host
			a.given[uid] = ip
			return ip, nil
		}
	}
	return netip.Addr{}, fmt.Errorf("node %s: no free address left in %s", node.Name, prefix)
}

// started is the status a kubelet reports once every container of the pod runs and is ready.
func started(pod *corev1.Pod, hostIP, podIP string) *corev1.PodStatus {
	now := metav1.Now()
	st := pod.Status.DeepCopy()
	st.Phase = corev1.PodRunning
	st.HostIP, st.HostIPs = hostIP, []corev1.HostIP{{IP: hostIP}}
	st.PodIP, st.PodIPs = podIP, []corev1.PodIP{{IP: podIP}}
	st.StartTime = &now
	conditions := []corev1.PodCondition{}
	for _, c := range st.Conditions {
		if c.Type == corev1.PodScheduled {
			conditions = append(conditions, c)
		}
	}
	for _, t := range []corev1.PodConditionType{corev1.PodInitialized, corev1.PodReady, corev1.ContainersReady} {
		conditions = append(conditions, corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	st.Conditions = conditions
	st.InitContainerStatuses = nil
	for _, c := range pod.Spec.InitContainers {
		st.InitContainerStatuses = append(st.InitContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, Ready: true, Started: ptr.To(false),
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
				ExitCode: 0, Reason: "Completed", StartedAt: now, FinishedAt: now}}})
	}
	st.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		st.ContainerStatuses = append(st.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Image: c.Image, Ready: true, Started: ptr.To(true),
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}})
	}
	return st
}

// sync brings one pod (namespace/name) to where a kubelet would take it.
func (a *agent) sync(ctx context.Context, key string) error {
	ns, name, err := cache.SplitMetaNamespaceKey(key)
	if err != nil {
		return nil
	}
	pod, err := a.pods.Pods(ns).Get(name)
	if apierrors.IsNotFound(err) {
		a.forgetGone()
		return nil
	}
	if err != nil {
		return err
	}
	node := a.node(pod.Spec.NodeName)
	if node == nil {
		return nil
	}
	if pod.DeletionTimestamp != nil {
		err := a.client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{
			GracePeriodSeconds: ptr.To[int64](0), Preconditions: &metav1.Preconditions{UID: &pod.UID}})
		if apierrors.IsNotFound(err) || apierrors.IsConflict(err) {
			return nil
		}
		return err
	}
	if pod.Status.PodIP != "" || (pod.Status.Phase != "" && pod.Status.Phase != corev1.PodPending) {
		return nil
	}
	hostIP := internalIP(node)
	podIP := hostIP
	if !pod.Spec.HostNetwork {
		ip, err := a.podIP(node, string(pod.UID))
		if err != nil {
			return err
		}
		podIP = ip.String()
	}
	update := pod.DeepCopy()
	update.Status = *started(pod, hostIP, podIP)
	_, err = a.client.CoreV1().Pods(ns).UpdateStatus(ctx, update, metav1.UpdateOptions{})
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

// forgetGone frees the IPs of pods that are gone (the lister no longer has their UID).
func (a *agent) forgetGone() {
	pods, err := a.pods.List(labels.Everything())
	if err != nil {
		return
	}
	live := map[string]bool{}
	for _, p := range pods {
		live[string(p.UID)] = true
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for uid := range a.given {
		if !live[uid] {
			delete(a.given, uid)
		}
	}
}

func (a *agent) work(ctx context.Context) {
	for {
		key, quit := a.queue.Get()
		if quit {
			return
		}
		if err := a.sync(ctx, key); err != nil {
			log.Printf("pod %s: %v (retrying)", key, err)
			a.queue.AddRateLimited(key)
		} else {
			a.queue.Forget(key)
		}
		a.queue.Done(key)
	}
}

// heartbeat reports each of our nodes Ready and renews its Lease, as a kubelet does.
func (a *agent) heartbeat(ctx context.Context) {
	nodes, err := a.nodes.List(labels.Everything())
	if err != nil {
		return
	}
	now := metav1.Now()
	for _, n := range nodes {
		if !a.ours(n) {
			continue
		}
		update := n.DeepCopy()
		update.Status.Conditions = nil
		for _, c := range []struct {
			t      corev1.NodeConditionType
			s      corev1.ConditionStatus
			reason string
		}{{corev1.NodeReady, corev1.ConditionTrue, "KubeletReady"},
			{corev1.NodeMemoryPressure, corev1.ConditionFalse, "KubeletHasSufficientMemory"},
			{corev1.NodeDiskPressure, corev1.ConditionFalse, "KubeletHasNoDiskPressure"},
			{corev1.NodePIDPressure, corev1.ConditionFalse, "KubeletHasSufficientPID"},
			{corev1.NodeNetworkUnavailable, corev1.ConditionFalse, "RouteCreated"}} {
			since := now
			for _, old := range n.Status.Conditions {
				if old.Type == c.t && old.Status == c.s {
					since = old.LastTransitionTime
				}
			}
			update.Status.Conditions = append(update.Status.Conditions, corev1.NodeCondition{
				Type: c.t, Status: c.s, Reason: c.reason, LastHeartbeatTime: now, LastTransitionTime: since})
		}
		if _, err := a.client.CoreV1().Nodes().UpdateStatus(ctx, update, metav1.UpdateOptions{}); err != nil && !apierrors.IsConflict(err) {
			log.Printf("node %s: status: %v", n.Name, err)
		}
		a.renew(ctx, n, now)
	}
}

func (a *agent) renew(ctx context.Context, n *corev1.Node, now metav1.Time) {
	leases := a.client.CoordinationV1().Leases(leaseNamespace)
	renewed := metav1.NewMicroTime(now.Time)
	lease, err := leases.Get(ctx, n.Name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		lease = &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: n.Name, Namespace: leaseNamespace, OwnerReferences: []metav1.OwnerReference{
				{APIVersion: "v1", Kind: "Node", Name: n.Name, UID: n.UID}}},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(n.Name), LeaseDurationSeconds: ptr.To[int32](40),
				RenewTime: &renewed}}
		_, err = leases.Create(ctx, lease, metav1.CreateOptions{})
	} else if err == nil {
		lease.Spec.RenewTime = &renewed
		_, err = leases.Update(ctx, lease, metav1.UpdateOptions{})
	}
	if err != nil && !apierrors.IsConflict(err) && !apierrors.IsAlreadyExists(err) {
		log.Printf("node %s: lease: %v", n.Name, err)
	}
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "the cluster's kubeconfig")
	selector := flag.String("node-annotation", "pdrollout.io/fake-node=true", "KEY=VALUE: the nodes this agent runs")
	every := flag.Duration("heartbeat", 10*time.Second, "how often each node reports Ready and renews its Lease")
	flag.Parse()
	key, value, ok := strings.Cut(*selector, "=")
	if !ok || key == "" {
		fmt.Fprintf(os.Stderr, "fakenodes: --node-annotation %q is not KEY=VALUE\n", *selector)
		os.Exit(2)
	}
	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fmt.Fprintf(os.Stderr, "fakenodes: %v\n", err)
		os.Exit(2)
	}
	config.QPS, config.Burst = 100, 200 // a test's burst of pods starts at once
	client := kubernetes.NewForConfigOrDie(config)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	factory := informers.NewSharedInformerFactory(client, 0)
	nodeInformer, podInformer := factory.Core().V1().Nodes(), factory.Core().V1().Pods()
	a := &agent{client: client, nodes: nodeInformer.Lister(), pods: podInformer.Lister(),
		queue: workqueue.NewTypedRateLimitingQueue(workqueue.DefaultTypedControllerRateLimiter[string]()),
		key:   key, value: value, given: map[string]netip.Addr{}, cursor: map[string]int{}}
	enqueue := func(obj any) {
		if k, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			a.queue.Add(k)
		}
	}
	podInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueue, UpdateFunc: func(_, obj any) { enqueue(obj) }, DeleteFunc: enqueue})
	// A pod bound before its node was seen waits for the node.
	nodeInformer.Informer().AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: func(obj any) {
		pods, _ := a.pods.List(labels.Everything())
		for _, p := range pods {
			if n, ok := obj.(*corev1.Node); ok && p.Spec.NodeName == n.Name {
				enqueue(p)
			}
		}
	}})
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), nodeInformer.Informer().HasSynced, podInformer.Informer().HasSynced) {
		os.Exit(1)
	}
	log.Printf("running the nodes annotated %s=%s", key, value)
	for i := 0; i < 4; i++ {
		go a.work(ctx)
	}
	go func() {
		<-ctx.Done()
		a.queue.ShutDown()
	}()
	tick := time.NewTicker(*every)
	defer tick.Stop()
	for {
		a.heartbeat(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}
