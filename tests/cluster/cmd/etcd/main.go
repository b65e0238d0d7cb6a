// Command etcd is etcd's own server entry point (go.etcd.io/etcd/server/v3/etcdmain), built from
// the server module because etcd's main package lives in a module that pins its siblings with
// local replace directives and so cannot be built from the module proxy.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
