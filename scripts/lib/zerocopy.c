// Loopback TCP: send() against send(MSG_ZEROCOPY) of the same blocks, taking
// turns in one run (scripts/bench-zerocopy.sh). A reader thread drains.
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <unistd.h>
#include <errno.h>
#include <time.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <linux/errqueue.h>
#ifndef SO_ZEROCOPY
#define SO_ZEROCOPY 60
#endif
#ifndef MSG_ZEROCOPY
#define MSG_ZEROCOPY 0x4000000
#endif
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void* reader(void*a){int fd=*(int*)a;char*b=malloc(1<<20);while(recv(fd,b,1<<20,0)>0);return 0;}
static long drain_err(int fd){ // completions
  char c[256]; struct msghdr m={0}; m.msg_control=c; m.msg_controllen=sizeof c; long n=0;
  while(recvmsg(fd,&m,MSG_ERRQUEUE|MSG_DONTWAIT)>=0){ n++; m.msg_controllen=sizeof c;} return n;}
int main(int argc,char**argv){
  size_t blk = argc>1? strtoul(argv[1],0,0) : (1<<20); double secs=2;
  for(int round=0;round<3;round++) for(int zc=0;zc<2;zc++){
    int l=socket(AF_INET,SOCK_STREAM,0); struct sockaddr_in a={.sin_family=AF_INET,.sin_addr.s_addr=htonl(0x7f000001)};
    bind(l,(void*)&a,sizeof a); socklen_t al=sizeof a; getsockname(l,(void*)&a,&al); listen(l,1);
    int c=socket(AF_INET,SOCK_STREAM,0); connect(c,(void*)&a,sizeof a); int s=accept(l,0,0);
    pthread_t t; pthread_create(&t,0,reader,&s);
    int one=1; if(zc && setsockopt(c,SOL_SOCKET,SO_ZEROCOPY,&one,sizeof one)){perror("SO_ZEROCOPY");return 1;}
    char*buf=aligned_alloc(4096,blk*8); memset(buf,1,blk*8);
    double t0=now(); size_t sent=0; long comps=0; int i=0;
    while(now()-t0<secs){ ssize_t n=send(c,buf+(i++%8)*blk,blk,zc?MSG_ZEROCOPY:0); if(n<0){ if(errno==ENOBUFS){comps+=drain_err(c);continue;} perror("send");break;} sent+=n; if(zc && (i%8)==0) comps+=drain_err(c);}
    double el=now()-t0; shutdown(c,SHUT_WR); pthread_join(t,0);
    printf("round %d %s block %zu: %.2f GB/s\n",round,zc?"MSG_ZEROCOPY":"send        ",blk,sent/el/1e9);
    close(c);close(s);close(l);free(buf);
  }
}
