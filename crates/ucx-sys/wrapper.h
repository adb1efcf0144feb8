#include <ucp/api/ucp.h>
#include <ucm/api/ucm.h>
