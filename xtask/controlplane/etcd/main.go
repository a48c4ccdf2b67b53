// Command etcd is etcd's server, built at the version k8s.io/kubernetes
// v1.34.4 was tested with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
