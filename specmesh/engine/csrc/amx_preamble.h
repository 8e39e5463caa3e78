#include <sys/syscall.h>
#include <unistd.h>
typedef struct { uint8_t palette, start; uint8_t pad[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;
static int amx_permission(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
