// Trivial out-of-tree module used by the kmod/qemu demo to show that an unsigned
// module built against the Debian headers loads and unloads in the QEMU guest.
#include <linux/module.h>
#include <linux/init.h>

static int __init ringllm_hello_init(void)
{
	pr_info("ringllm_hello: loaded\n");
	return 0;
}

static void __exit ringllm_hello_exit(void)
{
	pr_info("ringllm_hello: unloaded\n");
}

module_init(ringllm_hello_init);
module_exit(ringllm_hello_exit);
MODULE_LICENSE("GPL");
MODULE_DESCRIPTION("ringllm QEMU harness demo module");
